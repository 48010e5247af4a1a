//! A ruleset file, or a policy test-set file, as an operator writes it (YAML or JSON), read as
//! the CLI reads it: parsing and validation never panic, and no input expands in memory
//! (anchors and aliases are refused before a value is built; `cargo xtask fuzz` runs this with
//! an RSS and a malloc limit, so an alias bomb that got through would fail the run).
#![no_main]

use innerwall_control_plane::foresight::policy_tests::parse_test_set_file;
use innerwall_control_plane::policy::file;
use innerwall_control_plane::policy::spec::{parse_ruleset_file, validate_ruleset};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(spec) = parse_ruleset_file("fuzz.yaml", text) {
        let _ = validate_ruleset(&spec);
    }
    // A test set is parsed and checked (`check_set`) the same way.
    let _ = parse_test_set_file("fuzz.yaml", text);
    // Any shape at all, as a file other than a ruleset would be read.
    let _ = file::parse::<serde_norway::Value>("fuzz.yaml", text);
});
