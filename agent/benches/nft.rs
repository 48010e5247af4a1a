//! PERF-5: nftables full replace of 200 rules / 50,000 CIDRs and a 100+100-element peer delta,
//! in a fresh network namespace (needs root). `cargo bench -p innerwall-agent --bench nft`.

use std::fs::File;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::AsRawFd as _;
use std::process::Command;
use std::time::{Duration, Instant};

use innerwall_agent::enforce::desired::DesiredTable;
use innerwall_agent::enforce::{LinuxPolicyStore, PolicyStore as _, netlink, nft, state};
use innerwall_wire::policy::{Cidr, Mode, PortRange, Protocol, ResolvedRule, RuleId, WorkloadPolicy};

const RULES: u32 = 200;
const CIDRS_PER_RULE: u32 = 250;
const ITERATIONS: usize = 9;

/// 200 TCP rules with 250 host routes each, spaced so none merge (50,000 intervals).
/// `replaced(rule, peer)` picks the peers swapped for fresh addresses.
fn policy(version: u64, replaced: impl Fn(u32, u32) -> bool + Copy) -> WorkloadPolicy {
    let rules = (0..RULES).map(|r| {
        let peers = (0..CIDRS_PER_RULE).map(move |j| {
            let replaced = replaced;
            let n = r * CIDRS_PER_RULE + j;
            let base = if replaced(r, j) { 0x0B00_0000 } else { 0x0A00_0000 };
            Cidr::host(IpAddr::V4(Ipv4Addr::from(base + n * 2))).expect("host route")
        });
        let port = PortRange::single(1000 + r as u16).expect("port");
        ResolvedRule::new(RuleId::new(&format!("rule-{r}"), Protocol::Tcp).expect("id"), [port], peers)
            .expect("rule")
    });
    WorkloadPolicy::new(version, Mode::Enforcement, rules).expect("policy")
}

/// Prints the median and max of `samples`; returns the median in ms.
fn stats(name: &str, mut samples: Vec<Duration>) -> f64 {
    samples.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let median = ms(samples[samples.len() / 2]);
    println!(
        "{name:<58} median {median:>8.2} ms   max {:>8.2} ms   ({} runs)",
        ms(*samples.last().expect("samples")),
        samples.len()
    );
    median
}

/// A `FIGURE` line for `cargo xtask bench`: a median in ms and its goal.
fn figure(name: &str, median: f64, bound: Option<f64>) {
    let goal = bound.map_or("null".to_owned(), |b| format!("{{\"op\":\"<\",\"bound\":{b}}}"));
    println!(
        "FIGURE {{\"id\":\"PERF-5\",\"name\":\"{name}\",\"value\":{median:.3},\"unit\":\"ms\",\"goal\":{goal},\"context\":{{\"rules\":{RULES},\"cidrs\":{}}}}}",
        RULES * CIDRS_PER_RULE
    );
}

fn time<T>(f: impl FnOnce() -> T) -> (Duration, T) {
    let start = Instant::now();
    let out = f();
    (start.elapsed(), out)
}

#[allow(unsafe_code)]
fn enter(ns: &str) {
    let file = File::open(format!("/run/netns/{ns}")).expect("netns file");
    // SAFETY: setns(2) on a valid namespace fd; moves only this thread.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let ns = format!("iwbench-{}", std::process::id());
    let ok = Command::new("ip").args(["netns", "add", &ns]).status().is_ok_and(|s| s.success());
    assert!(ok, "the nft benchmark needs root and `ip netns add`");
    let state = std::env::temp_dir().join(&ns);
    let result = std::thread::scope(|s| {
        s.spawn(|| {
            enter(&ns);
            bench(&state);
        })
        .join()
    });
    let _ = Command::new("ip").args(["netns", "del", &ns]).status();
    let _ = std::fs::remove_dir_all(&state);
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}

fn bench(state: &std::path::Path) {
    let a = policy(1, |_, _| false);
    // 100 peers out, 100 in: one peer in each of 100 rules (100 sets touched) …
    let b = policy(2, |r, j| j == 0 && r < 100);
    // … or 100 peers of one rule (one set touched).
    let c = policy(3, |r, j| r == 7 && j < 100);
    let (da, db, dc) =
        (DesiredTable::from_policy(&a), DesiredTable::from_policy(&b), DesiredTable::from_policy(&c));
    let peers: usize = a.rules().map(|r| r.peers().len()).sum();
    println!(
        "PERF-5 nftables: {} rules, {peers} CIDRs ({} kernel rules, {} sets)",
        RULES,
        da.rules.len(),
        da.sets.len()
    );

    let mut build = Vec::new();
    let mut full = Vec::new();
    for _ in 0..ITERATIONS {
        let (t_build, batch) = time(|| nft::full_replace_batch(&da));
        let (t_send, sent) = time(|| batch.send());
        sent.expect("full replace");
        build.push(t_build);
        full.push(t_build + t_send);
    }
    figure("full replace", stats("full replace (build + one atomic batch)", full), Some(500.0));
    stats("  of which building the batch", build);

    let forward = db.element_update_from(&da).expect("peer-only");
    let backward = da.element_update_from(&db).expect("peer-only");
    let count = |u: &std::collections::BTreeMap<String, _>| {
        u.values()
            .map(|d: &innerwall_agent::enforce::desired::ElementDiff| d.remove.len() + d.add.len())
            .sum::<usize>()
    };
    let mut delta = Vec::new();
    for i in 0..ITERATIONS * 2 {
        let (desired, update) = if i % 2 == 0 { (&db, &forward) } else { (&da, &backward) };
        let (t, sent) = time(|| nft::element_batch(desired, update).send());
        sent.expect("element delta");
        delta.push(t);
    }
    let spread =
        stats(&format!("peer delta 100+100 peers over 100 sets ({} element ops)", count(&forward)), delta);
    figure("peer-only delta, 100+100 peers over 100 sets", spread, Some(20.0));
    let (forward, backward) =
        (dc.element_update_from(&da).expect("peer-only"), da.element_update_from(&dc).expect("peer-only"));
    let mut delta = Vec::new();
    for i in 0..ITERATIONS * 2 {
        let (desired, update) = if i % 2 == 0 { (&dc, &forward) } else { (&da, &backward) };
        let (t, sent) = time(|| nft::element_batch(desired, update).send());
        sent.expect("element delta");
        delta.push(t);
    }
    let one = stats(&format!("peer delta 100+100 peers in 1 set ({} element ops)", count(&forward)), delta);
    figure("peer-only delta, 100+100 peers in 1 set", one, Some(20.0));

    let mut store = LinuxPolicyStore::new(state);
    store.apply(&a).expect("apply a");
    let mut applied = Vec::new();
    for i in 0..ITERATIONS * 2 {
        let next = if i % 2 == 0 {
            b.clone().with_version(i as u64 + 2)
        } else {
            a.clone().with_version(i as u64 + 2)
        };
        let (t, how) = time(|| store.apply(&next));
        assert!(matches!(how.expect("apply"), innerwall_agent::enforce::Installed::Elements { .. }));
        applied.push(t);
    }
    stats("PolicyStore::apply of that delta (persist + fsync + install)", applied);

    let mut full_apply = Vec::new();
    for i in 0..ITERATIONS {
        let mode = if i % 2 == 0 { Mode::Simulation } else { Mode::Enforcement };
        let next = WorkloadPolicy::new(100 + i as u64, mode, a.rules().cloned()).expect("policy");
        let (t, how) = time(|| store.apply(&next));
        assert_eq!(how.expect("apply"), innerwall_agent::enforce::Installed::Full);
        full_apply.push(t);
    }
    stats("PolicyStore::apply full (persist + fsync + install)", full_apply);

    let expected = nft::expected_state(&da);
    nft::full_replace_batch(&da).send().expect("reinstall a");
    let mut readback = Vec::new();
    for _ in 0..ITERATIONS {
        let (t, state) = time(|| state::read_table().expect("read").expect("table"));
        assert!(state.differences(&expected).is_empty());
        readback.push(t);
    }
    stats("drift: full readback + comparison", readback);
    let mut generation = Vec::new();
    for _ in 0..ITERATIONS {
        generation.push(time(|| netlink::generation().expect("gen")).0);
    }
    stats("drift: generation id check (the cheap trigger)", generation);
}
