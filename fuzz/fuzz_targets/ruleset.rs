//! A ruleset file as an operator writes it (YAML or JSON): parsing and validation never panic.
#![no_main]

use innerwall_control_plane::policy::spec::{RulesetSpec, validate_ruleset};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(spec) = serde_norway::from_str::<RulesetSpec>(text) {
        let _ = validate_ruleset(&spec);
    }
});
