//! The systemd units as shipped (issue 32): `systemd-analyze verify` passes and the offline
//! security rating of each is an exposure of 4.0 or lower. `verify` needs `ExecStart`'s binary
//! at its path, so each unit is checked as a copy whose `ExecStart` names the built binary.

use std::process::Command;

/// Each unit, its file in the workspace, and the binary its `ExecStart` runs.
const UNITS: [(&str, &str, &str); 2] = [
    ("innerwall.service", "control-plane/systemd/innerwall.service", "innerwall"),
    ("innerwall-agent.service", "agent/systemd/innerwall-agent.service", "innerwall-agent"),
];

const MAX_EXPOSURE: f64 = 4.0;

#[test]
fn units_are_hardened() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let dir = std::env::temp_dir().join(format!("iw-units-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, file, binary) in UNITS {
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        let shipped = format!("/usr/bin/{binary}");
        assert!(text.contains(&format!("ExecStart={shipped}")), "{name} runs {shipped}");
        let built = innerwall_e2e::workspace_bin(binary);
        let copy = dir.join(name);
        std::fs::write(&copy, text.replace(&shipped, &built.to_string_lossy())).unwrap();

        let verify =
            Command::new("systemd-analyze").arg("verify").arg(&copy).output().expect("systemd-analyze");
        let said = String::from_utf8_lossy(&verify.stderr).into_owned();
        // Only what is about this unit counts (the host's own units may draw warnings).
        let about: Vec<&str> = said.lines().filter(|l| l.contains(name)).collect();
        assert!(verify.status.success() && about.is_empty(), "{name}: {said}");

        let rated = Command::new("systemd-analyze")
            .args(["security", "--offline=true", "--no-pager"])
            .arg(&copy)
            .output()
            .expect("systemd-analyze security");
        let out = String::from_utf8_lossy(&rated.stdout);
        let exposure: f64 = out
            .lines()
            .find_map(|l| l.split(&format!("Overall exposure level for {name}: ")).nth(1))
            .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| panic!("{name}: no overall exposure in\n{out}"));
        println!("{name}: exposure {exposure}");
        assert!(exposure <= MAX_EXPOSURE, "{name}: exposure {exposure} over {MAX_EXPOSURE}\n{out}");
    }
    std::fs::remove_dir_all(&dir).ok();
}
