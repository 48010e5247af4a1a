//! The tc classifier `innerwall_ingress`: counts IPv4/IPv6 packets per L4 protocol, never drops any.
#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::TC_ACT_PIPE,
    btf_maps::PerCpuArray,
    macros::{btf_map, classifier},
    programs::TcContext,
};

const ETH_HDR_LEN: usize = 14;
const ETH_TYPE_OFFSET: usize = 12;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86DD;
/// Offset of the protocol byte inside the IPv4 header.
const IPV4_PROTOCOL_OFFSET: usize = 9;
/// Offset of the next-header byte inside the IPv6 header. Extension headers are not
/// walked, so e.g. fragments count under protocol 44.
const IPV6_NEXT_HEADER_OFFSET: usize = 6;

/// Packets seen per IPv4 protocol number (the index), per CPU.
#[btf_map]
static IPV4_PACKETS: PerCpuArray<u64, 256> = PerCpuArray::new();

/// Packets seen per IPv6 next-header value (the index), per CPU.
#[btf_map]
static IPV6_PACKETS: PerCpuArray<u64, 256> = PerCpuArray::new();

/// Observes only: the verdict is always `TC_ACT_PIPE`, so a bug here can never cut traffic.
#[classifier]
pub fn innerwall_ingress(ctx: TcContext) -> i32 {
    count_packet(&ctx);
    TC_ACT_PIPE
}

#[inline(always)]
fn count_packet(ctx: &TcContext) {
    let Ok(ether_type) = ctx.load::<u16>(ETH_TYPE_OFFSET) else {
        return;
    };
    let (counters, protocol_offset) = match u16::from_be(ether_type) {
        ETH_P_IP => (&IPV4_PACKETS, ETH_HDR_LEN + IPV4_PROTOCOL_OFFSET),
        ETH_P_IPV6 => (&IPV6_PACKETS, ETH_HDR_LEN + IPV6_NEXT_HEADER_OFFSET),
        _ => return,
    };
    let Ok(protocol) = ctx.load::<u8>(protocol_offset) else {
        return;
    };
    if let Some(counter) = counters.get_ptr_mut(u32::from(protocol)) {
        // SAFETY: the pointer is this CPU's slot of a per-CPU array, valid for the whole
        // program run and touched by no other CPU, so a plain increment cannot race.
        unsafe { *counter += 1 };
    }
}

/// Declared explicitly so the kernel sees the crate's real licence. It is not GPL
/// compatible, so GPL-only helpers are unavailable to these programs.
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 11] = *b"Apache-2.0\0";

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // Nothing here can panic at run time (the verifier would reject the loop anyway);
    // no_std still demands a handler.
    loop {}
}
