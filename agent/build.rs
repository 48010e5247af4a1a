//! With the `embedded-ebpf` feature, copies the eBPF object into OUT_DIR for `include_bytes`
//! (`evidence::capture::daemon_object`): from `$INNERWALL_EBPF_EMBED`, else the workspace's
//! `target/bpf/innerwall-ebpf`, which `cargo xtask build-ebpf` writes. Without the feature it
//! does nothing, so a plain build needs no BPF toolchain.

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=INNERWALL_EBPF_EMBED");
    if std::env::var_os("CARGO_FEATURE_EMBEDDED_EBPF").is_none() {
        return;
    }
    let manifest =
        PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let object = std::env::var_os("INNERWALL_EBPF_EMBED")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest.join("../target/bpf/innerwall-ebpf"));
    println!("cargo:rerun-if-changed={}", object.display());
    let bytes = std::fs::read(&object).unwrap_or_else(|e| {
        panic!(
            "the embedded-ebpf feature needs the eBPF object at {} ({e}): run `cargo xtask build-ebpf` \
             or set INNERWALL_EBPF_EMBED",
            object.display()
        )
    });
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("innerwall-ebpf");
    std::fs::write(&out, bytes).unwrap_or_else(|e| panic!("writing {}: {e}", out.display()));
}
