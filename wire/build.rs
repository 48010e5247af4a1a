//! Compiles the agent contract in `proto/` with a vendored `protoc` unless `PROTOC` is set.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    println!("cargo:rerun-if-env-changed=PROTOC");
    if std::env::var_os("PROTOC").is_none() {
        let protoc: PathBuf = protoc_bin_vendored::protoc_bin_path()?;
        // SAFETY: a build script is single-threaded here; nothing else reads the environment.
        #[allow(unsafe_code, clippy::disallowed_methods)]
        unsafe {
            std::env::set_var("PROTOC", protoc)
        };
    }
    let files = [
        "proto/innerwall/agent/v1/common.proto",
        "proto/innerwall/agent/v1/policy.proto",
        "proto/innerwall/agent/v1/enroll.proto",
        "proto/innerwall/agent/v1/sync.proto",
        "proto/innerwall/agent/v1/telemetry.proto",
    ];
    // Every service uses the contract's own codec: small starting buffers (see `src/codec.rs`).
    tonic_prost_build::configure()
        .codec_path("crate::codec::LeanCodec")
        .compile_protos(&files, &["proto"])?;
    Ok(())
}
