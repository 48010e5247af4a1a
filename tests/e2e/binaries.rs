//! Both binaries build and speak the same contract package as `wire`.

use std::process::Command;

use innerwall_e2e::workspace_bin;

#[test]
fn both_binaries_speak_the_wire_contract_package() {
    for name in ["innerwall", "innerwall-agent"] {
        let bin = workspace_bin(name);
        let out = Command::new(&bin).arg("contract").output().unwrap();
        assert!(out.status.success(), "{name} contract failed: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), innerwall_wire::CONTRACT_PACKAGE, "{name}");
    }
}
