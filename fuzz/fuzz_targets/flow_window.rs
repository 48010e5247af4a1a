//! A flow window from an agent: validation never panics, and an accepted window survives the
//! round trip to the wire and back unchanged.
#![no_main]

use innerwall_wire::flows::FlowWindow;
use innerwall_wire::proto;
use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let Ok(wire) = proto::FlowWindow::decode(data) else { return };
    if let Ok(window) = FlowWindow::try_from(&wire) {
        let again =
            FlowWindow::try_from(&proto::FlowWindow::from(&window)).expect("a valid window re-validates");
        assert_eq!(again, window);
    }
});
