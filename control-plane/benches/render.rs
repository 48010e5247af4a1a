//! PERF-1: a full render of 10,000 workloads, 1,000 rulesets and 5,000 rules (target < 1 s,
//! memory linear), and of ten times that estate (100,000 workloads in 5,000 apps of 20). Prints
//! the figures; run with
//! `cargo bench -p innerwall-control-plane --bench render`.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr};
use std::time::Instant;

use innerwall_control_plane::policy::model::{
    AddressGroup, AuthoredModel, Peer, RegisteredWorkload, Rule, Ruleset, Selector, Service, ServiceEntry,
};
use innerwall_control_plane::policy::render::render;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::labels::{LabelKey, LabelValue};
use innerwall_wire::policy::{Cidr, Mode};
use uuid::Uuid;

/// Workloads in each app.
const MEMBERS: usize = 20;

fn selector(key: &str, value: String) -> Selector {
    Selector::from_strings([(key.to_string(), vec![value])]).unwrap()
}

fn estate(workloads: usize, apps: usize) -> Vec<RegisteredWorkload> {
    (0..workloads)
        .map(|i| RegisteredWorkload {
            id: WorkloadId::new_random(),
            mode: Mode::Enforcement,
            revert_at: None,
            labels: BTreeMap::from([
                (LabelKey::new("app").unwrap(), LabelValue::new(&format!("app{}", i % apps)).unwrap()),
                (LabelKey::new("env").unwrap(), LabelValue::new(&format!("env{}", i % 5)).unwrap()),
            ]),
            addresses: BTreeSet::from([IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i as u32))]),
        })
        .collect()
}

fn model(rulesets: usize, rules_per_set: usize, apps: usize) -> AuthoredModel {
    let services: BTreeMap<Uuid, Service> = (0..200)
        .map(|i| {
            let entries = vec![ServiceEntry::parse(&format!("tcp:{},{}", 1000 + i, 2000 + i)).unwrap()];
            let s = Service { id: Uuid::new_v4(), name: format!("s{i}"), entries };
            (s.id, s)
        })
        .collect();
    let groups: BTreeMap<Uuid, AddressGroup> = (0..100)
        .map(|i| {
            let cidrs = (0..10).map(|j| Cidr::parse(&format!("172.{i}.{j}.0/24")).unwrap()).collect();
            let g = AddressGroup { id: Uuid::new_v4(), name: format!("g{i}"), cidrs };
            (g.id, g)
        })
        .collect();
    let service_ids: Vec<Uuid> = services.keys().copied().collect();
    let group_ids: Vec<Uuid> = groups.keys().copied().collect();
    let rulesets = (0..rulesets)
        .map(|j| Ruleset {
            id: Uuid::new_v4(),
            name: format!("rs{j}"),
            enabled: true,
            scope: selector("app", format!("app{}", j % apps)),
            rules: (0..rules_per_set)
                .map(|k| Rule {
                    id: Uuid::new_v4(),
                    name: format!("r{k}"),
                    enabled: true,
                    peers: vec![
                        Peer::Workloads(selector("app", format!("app{}", (j * 7 + k) % apps))),
                        Peer::AddressGroup(group_ids[(j + k) % group_ids.len()]),
                        Peer::Cidr(Cidr::parse(&format!("192.168.{}.0/24", k)).unwrap()),
                    ],
                    services: vec![service_ids[(j + k) % 200], service_ids[(j * 3 + k) % 200]],
                })
                .collect(),
        })
        .collect();
    AuthoredModel { services, address_groups: groups, rulesets, ..Default::default() }
}

fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn main() {
    println!(
        "PERF-1 full render (target: 10,000 workloads / 1,000 rulesets / 5,000 rules < 1 s, memory linear)"
    );
    println!(
        "{:>10} {:>9} {:>7} {:>14} {:>12} {:>14} {:>16}",
        "workloads", "rulesets", "rules", "resolved rules", "render ms", "peak RSS MiB", "output KiB/wl"
    );
    // `INNERWALL_BENCH_QUICK`: the smallest size only (a smoke run).
    let scales: &[usize] =
        if std::env::var_os("INNERWALL_BENCH_QUICK").is_some() { &[1] } else { &[1, 2, 4, 40] };
    let mut figures = Vec::new();
    for &scale in scales {
        let (workloads, rulesets) = (2_500 * scale, 250 * scale);
        let estate = estate(workloads, workloads / MEMBERS);
        let model = model(rulesets, 5, workloads / MEMBERS);
        let mut best = f64::MAX;
        let mut resolved = 0;
        let mut bytes = 0;
        for _ in 0..3 {
            let start = Instant::now();
            let out = render(&model, &estate).unwrap();
            best = best.min(start.elapsed().as_secs_f64() * 1000.0);
            resolved = out.iter().map(|(_, p)| p.rules().len()).sum::<usize>();
            bytes = out.iter().map(|(_, p)| p.canonical_bytes().len()).sum::<usize>();
        }
        println!(
            "{workloads:>10} {rulesets:>9} {:>7} {resolved:>14} {best:>12.1} {:>14.1} {:>16.2}",
            rulesets * 5,
            peak_rss_kib() as f64 / 1024.0,
            bytes as f64 / 1024.0 / workloads as f64
        );
        figures.push((workloads, best));
    }
    // The largest two sizes: 10,000 (PERF-1's goal) and 100,000 (its render is a part of the
    // end-to-end goals `publish` measures).
    for (workloads, best) in figures.into_iter().rev().take(2) {
        println!(
            "FIGURE {{\"id\":\"PERF-1\",\"name\":\"pure render\",\"value\":{best:.3},\"unit\":\"ms\",\"goal\":{{\"op\":\"<\",\"bound\":1000}},\"context\":{{\"workloads\":{workloads}}}}}"
        );
    }
}
