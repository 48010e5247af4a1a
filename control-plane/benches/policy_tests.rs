//! PERF-9 (part): the per-commit evaluation of 200 policy tests (100 allow, 50 deny, 50
//! only_from) over a rendered estate of 10,000 workloads / 1,000 rulesets / 5,000 rules (goal:
//! adds < 100 ms to a commit). The evaluation is pure over the commit's `Rendering`; the test
//! sets' read is one small query beside it. Also printed: the pure part an `observed` test adds
//! (choosing the workloads its replay proposes and judging the replay's result); the replay of
//! recorded flows itself is `foresight::impact`, measured by `cargo xtask bench impact`, and
//! runs only for workloads whose rendered policy differs from the applied one. Run with
//! `cargo xtask bench policy-tests` (`INNERWALL_BENCH_QUICK`: a quarter of the estate, one round).

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr};
use std::time::Instant;

use innerwall_control_plane::foresight::policy_tests::{
    FlowSpec, Observations, ObservedSpec, OnlyFromSpec, TestSetSpec, TestSpec, evaluate, replays,
};
use innerwall_control_plane::foresight::{Impact, Range};
use innerwall_control_plane::policy::inputs::Outcome;
use innerwall_control_plane::policy::model::{
    AuthoredModel, Peer, RegisteredWorkload, Rule, Ruleset, Selector, Service, ServiceEntry,
};
use innerwall_control_plane::policy::publish::Rendering;
use innerwall_control_plane::policy::render::render;
use innerwall_control_plane::policy::spec::PeerSpec;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::labels::{LabelKey, LabelValue};
use innerwall_wire::policy::{Cidr, Mode};
use uuid::Uuid;

const APPS: usize = 500;
const SERVICES: usize = 200;

fn selector(value: String) -> Selector {
    Selector::from_strings([("app".to_string(), vec![value])]).unwrap()
}

fn app(i: usize) -> BTreeMap<String, Vec<String>> {
    [("app".to_owned(), vec![format!("app{}", i % APPS)])].into()
}

fn estate(workloads: usize) -> Vec<RegisteredWorkload> {
    (0..workloads)
        .map(|i| RegisteredWorkload {
            id: WorkloadId::new_random(),
            mode: Mode::Enforcement,
            revert_at: None,
            labels: BTreeMap::from([
                (LabelKey::new("app").unwrap(), LabelValue::new(&format!("app{}", i % APPS)).unwrap()),
                (LabelKey::new("env").unwrap(), LabelValue::new(&format!("env{}", i % 5)).unwrap()),
            ]),
            addresses: BTreeSet::from([IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i as u32))]),
        })
        .collect()
}

fn model(rulesets: usize) -> AuthoredModel {
    let services: BTreeMap<Uuid, Service> = (0..SERVICES)
        .map(|i| {
            let entries =
                vec![ServiceEntry::parse(&format!("tcp:{},{}-{}", 1000 + i, 2000 + i, 2010 + i)).unwrap()];
            let s = Service { id: Uuid::from_u128(1 + i as u128), name: format!("s{i}"), entries };
            (s.id, s)
        })
        .collect();
    let sid = |i: usize| Uuid::from_u128(1 + (i % SERVICES) as u128);
    let rulesets = (0..rulesets)
        .map(|j| Ruleset {
            id: Uuid::new_v4(),
            name: format!("rs{j}"),
            enabled: true,
            scope: selector(format!("app{}", j % APPS)),
            rules: (0..5)
                .map(|k| Rule {
                    id: Uuid::new_v4(),
                    name: format!("r{k}"),
                    enabled: true,
                    peers: vec![
                        Peer::Workloads(selector(format!("app{}", (j * 7 + k) % APPS))),
                        Peer::Cidr(Cidr::parse(&format!("192.168.{k}.0/24")).unwrap()),
                    ],
                    services: vec![sid(j + k)],
                })
                .collect(),
        })
        .collect();
    AuthoredModel { services, address_groups: BTreeMap::new(), rulesets, ..Default::default() }
}

fn tests() -> Vec<TestSetSpec> {
    let test = |name: String| TestSpec {
        name,
        description: String::new(),
        allow: None,
        deny: None,
        only_from: None,
        observed: None,
        allow_empty: false,
    };
    let mut out = Vec::new();
    for set in 0..4 {
        let mut tests = Vec::new();
        for t in 0..50 {
            let j = set * 50 + t;
            let service = format!("s{}", j % SERVICES);
            let spec = match set {
                0 | 1 => TestSpec {
                    allow: Some(FlowSpec { from: Some(app(j * 7)), from_cidr: None, to: app(j), service }),
                    ..test(format!("allow-{j}"))
                },
                2 => TestSpec {
                    deny: Some(FlowSpec {
                        from: None,
                        from_cidr: Some("203.0.113.0/24".into()),
                        to: app(j),
                        service,
                    }),
                    ..test(format!("deny-{j}"))
                },
                _ => TestSpec {
                    only_from: Some(OnlyFromSpec {
                        to: app(j),
                        service,
                        sources: vec![PeerSpec::workloads(app(j * 7)), PeerSpec::cidr("192.168.0.0/16")],
                    }),
                    ..test(format!("only-{j}"))
                },
            };
            tests.push(spec);
        }
        out.push(TestSetSpec { name: format!("set{set}"), description: String::new(), tests });
    }
    out
}

fn main() {
    println!("PERF-9 policy tests per commit (goal: 200 tests over 10,000 workloads add < 100 ms)");
    let quick = std::env::var_os("INNERWALL_BENCH_QUICK").is_some();
    let (workloads, rulesets, rounds) = if quick { (2_500, 250, 1) } else { (10_000, 1_000, 5) };
    let registry = estate(workloads);
    let model = model(rulesets);
    let rendered = render(&model, &registry).unwrap();
    let rendering = Rendering {
        model: model.into(),
        registry: registry.into(),
        rendered,
        changed: Vec::new(),
        narrowed: false,
        inputs: Outcome::Loaded,
    };
    let sets = tests();
    let count: usize = sets.iter().map(|s| s.tests.len()).sum();
    let mut best = f64::MAX;
    let mut failed = 0;
    for _ in 0..rounds {
        let start = Instant::now();
        let report = evaluate(&sets, &rendering, &Observations::new());
        best = best.min(start.elapsed().as_secs_f64() * 1000.0);
        failed = report.results.iter().filter(|r| !r.passed).count();
    }
    // One observed test beside them: its replay planned, then everything judged with the
    // replay's result (an impact listing its workloads, none of them newly blocked).
    let mut with_observed = sets.clone();
    with_observed[0].tests[0] = TestSpec {
        observed: Some(ObservedSpec { to: app(0), since: None }),
        allow: None,
        ..with_observed[0].tests[0].clone()
    };
    let mut observed_best = f64::MAX;
    let mut proposed = 0;
    for _ in 0..rounds {
        let start = Instant::now();
        let planned = replays(&with_observed, &rendering);
        proposed = planned.iter().map(|p| p.proposed.len()).sum();
        let observations: Observations = planned.iter().map(|p| (p.since, impact_of(p.since))).collect();
        let report = evaluate(&with_observed, &rendering, &observations);
        observed_best = observed_best.min(start.elapsed().as_secs_f64() * 1000.0);
        assert!(report.results[0].passed, "{:?}", report.results[0]);
    }
    let observed_extra = observed_best - best;
    println!("{:>10} {:>9} {:>6} {:>7} {:>12}", "workloads", "rulesets", "tests", "failing", "evaluate ms");
    println!("{workloads:>10} {rulesets:>9} {count:>6} {failed:>7} {best:>12.1}");
    println!(
        "FIGURE {{\"id\":\"PERF-9\",\"name\":\"200 policy tests over 10,000 workloads per commit\",\"value\":{best:.3},\"unit\":\"ms\",\"goal\":{{\"op\":\"<\",\"bound\":100}},\"context\":{{\"workloads\":{workloads},\"tests\":{count},\"failing\":{failed}}}}}"
    );
    println!(
        "with one observed test instead of an allow test ({proposed} workloads proposed): {observed_best:.1} ms \
         ({observed_extra:+.1} ms; its replay of recorded flows is `cargo xtask bench impact`)"
    );
    println!(
        "FIGURE {{\"id\":\"PERF-9\",\"name\":\"one observed policy test, pure part (planning and judging its replay)\",\"value\":{observed_best:.3},\"unit\":\"ms\",\"context\":{{\"workloads\":{workloads},\"tests\":{count},\"proposed\":{proposed},\"versus_structural_ms\":{best:.3}}}}}"
    );
}

/// What a replay of `since` returns when nothing it replays becomes blocked.
fn impact_of(since: std::time::Duration) -> Impact {
    let to = chrono::Utc::now();
    let from = to - chrono::Duration::from_std(since).unwrap();
    Impact { range: Range { from, to }, top: 10, workloads: Vec::new(), keys: 0 }
}
