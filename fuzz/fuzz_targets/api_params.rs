//! The API's query and path parameters: any query string parsed as every route's query type
//! (with the checks each handler makes before any I/O: flows, verdict, audit, lists, and a
//! workload replay's versions, range and `top`) and any path parameter value never
//! panic, and a value with a control character is never accepted as a path parameter.
#![no_main]

use innerwall_control_plane::api::{extract, parse_parameters};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let (query, value) = text.split_once('\u{1}').unwrap_or((&*text, &*text));
    parse_parameters(query, value);
    if value.chars().any(char::is_control) {
        assert!(extract::check_path_param("id", value).is_err(), "a control character was accepted");
    }
});
