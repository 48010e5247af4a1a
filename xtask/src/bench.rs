//! `cargo xtask bench [NAME…] [--quick]`: every benchmark of DESIGN.md §11, one after the
//! other, each printing its figures as `FIGURE {json}` lines among its own output. Collected,
//! they are printed one line each with their goal, the core count and the commit, and written to
//! `target/bench/bench-<unix time>.json` (and `latest.json`). `--quick` runs small sizes to
//! prove every benchmark still works (`.ci/run` does); its figures judge nothing. Quick runs
//! build as `cargo test --workspace` does (the `test` profile, the workspace's features), so
//! after the tests they build only the bench targets instead of the workspace again in release.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::{cmd, ebpf, leftovers, setup};

/// Where the agent (and its capture bench) reads the eBPF object from.
const OBJECT_ENV: &str = "INNERWALL_EBPF_OBJECT";

/// One benchmark: what runs it at full size, and the environment or arguments of `--quick`.
struct Bench {
    name: &'static str,
    what: &'static str,
    run: Run,
}

/// An environment variable a benchmark reads, with its value.
type Var = (&'static str, &'static str);

enum Run {
    /// `cargo bench -p PACKAGE --bench TARGET`, with the variables of `full` or of `quick`.
    Cargo { package: &'static str, target: &'static str, full: &'static [Var], quick: &'static [Var] },
    /// `innerwall-loadgen SCENARIO ARGS…`, with `quick` instead of `full`.
    Loadgen { full: &'static [&'static str], quick: &'static [&'static str] },
}

const BENCHES: &[Bench] = &[
    Bench {
        name: "render",
        what: "PERF-1 pure render, 10,000 and 100,000 workloads (1,000 and 10,000 rulesets)",
        run: Run::Cargo {
            package: "innerwall-control-plane",
            target: "render",
            full: &[],
            quick: &[("INNERWALL_BENCH_QUICK", "1")],
        },
    },
    Bench {
        name: "publish",
        what: "PERF-1 end to end: the publish transaction at 10,000 and 100,000 workloads",
        run: Run::Cargo {
            package: "innerwall-control-plane",
            target: "publish",
            full: &[],
            quick: &[("INNERWALL_BENCH_QUICK", "1")],
        },
    },
    Bench {
        name: "policy-tests",
        what: "PERF-9 part: 200 policy tests over 10,000 workloads, the evaluation every commit adds",
        run: Run::Cargo {
            package: "innerwall-control-plane",
            target: "policy_tests",
            full: &[],
            quick: &[("INNERWALL_BENCH_QUICK", "1")],
        },
    },
    Bench {
        name: "propagation",
        what: "PERF-2 commit → APPLIED, 5,000 agents on one replica",
        run: Run::Loadgen {
            full: &["propagation", "--agents", "5000", "--replicas", "1"],
            quick: &["propagation", "--agents", "20", "--replicas", "1", "--changes", "2"],
        },
    },
    Bench {
        name: "propagation-2",
        what: "PERF-2 commit → APPLIED, 5,000 agents over two replicas and a real agent in a network \
               namespace; then SYNC-11, a tenth of the agents stalled",
        run: Run::Loadgen {
            full: &["propagation", "--agents", "5000", "--replicas", "2", "--real-agent", "--slow", "500"],
            quick: &[
                "propagation",
                "--agents",
                "20",
                "--replicas",
                "2",
                "--changes",
                "2",
                "--real-agent",
                "--slow",
                "2",
            ],
        },
    },
    Bench {
        name: "storm",
        what: "PERF-3 reconnect storm, 5,000 agents",
        run: Run::Loadgen { full: &["storm", "--agents", "5000"], quick: &["storm", "--agents", "50"] },
    },
    Bench {
        name: "enroll",
        what: "PERF-3 enrollment, 10,000 agents",
        run: Run::Loadgen { full: &["enroll", "--agents", "10000"], quick: &["enroll", "--agents", "100"] },
    },
    Bench {
        name: "density",
        what: "PERF-4 idle streams on one replica, 10,000 agents",
        run: Run::Loadgen {
            full: &["density", "--agents", "10000"],
            quick: &[
                "density",
                "--agents",
                "100",
                "--settle",
                "1s",
                "--heartbeat",
                "2s",
                "--flows-per-minute",
                "60",
            ],
        },
    },
    Bench {
        name: "nft",
        what: "PERF-5 nftables full replace and peer-only deltas",
        run: Run::Cargo { package: "innerwall-agent", target: "nft", full: &[], quick: &[] },
    },
    Bench {
        name: "capture",
        what: "PERF-6 eBPF capture overhead on veth traffic",
        run: Run::Cargo {
            package: "innerwall-agent",
            target: "capture",
            full: &[],
            quick: &[("CAPTURE_BENCH_SECS", "0.5"), ("CAPTURE_BENCH_ROUNDS", "1")],
        },
    },
    Bench {
        name: "ingest",
        what: "PERF-7 flow ingest into Postgres",
        run: Run::Cargo {
            package: "innerwall-control-plane",
            target: "ingest",
            full: &[],
            quick: &[("INNERWALL_BENCH_QUICK", "1")],
        },
    },
    Bench {
        name: "rollup",
        what: "PERF-8 review rollups and the roll-up job over 10 M flow windows (of one record each)",
        run: Run::Cargo {
            package: "innerwall-control-plane",
            target: "rollup",
            full: &[("INNERWALL_BENCH_WINDOWS", "10000000"), ("INNERWALL_BENCH_RECORDS_PER_WINDOW", "1")],
            quick: &[("INNERWALL_BENCH_RECORDS", "100000")],
        },
    },
    Bench {
        name: "impact",
        what: "PERF-9 impact of a one-ruleset change, 1,000 workloads / 7 days of flows",
        run: Run::Cargo {
            package: "innerwall-control-plane",
            target: "impact",
            full: &[],
            quick: &[("INNERWALL_BENCH_QUICK", "1")],
        },
    },
    Bench {
        name: "suggest",
        what: "PERF-10 suggested policy: a 100-workload scope over 14 days, one workload over 24 h",
        run: Run::Cargo {
            package: "innerwall-control-plane",
            target: "suggest",
            full: &[],
            quick: &[("INNERWALL_BENCH_QUICK", "1")],
        },
    },
    Bench {
        name: "console",
        what: "PERF-11 the web console: fleet page, map of 150 groups, workload page at 10,000 workloads",
        run: Run::Cargo {
            package: "innerwall-control-plane",
            target: "console",
            full: &[],
            quick: &[("INNERWALL_BENCH_QUICK", "1")],
        },
    },
    Bench {
        name: "notify",
        what: "capacity model: the NOTIFY fan-out of one estate-wide change, 10,000 / 100,000 / 1,000,000 \
               workloads to 2 / 3 / 21 replicas",
        run: Run::Cargo {
            package: "innerwall-control-plane",
            target: "notify",
            full: &[],
            quick: &[("INNERWALL_BENCH_QUICK", "1")],
        },
    },
    Bench {
        name: "heartbeats",
        what: "capacity model: one heartbeat interval's writes at 100,000 and 1,000,000 agents (3 and 21 \
               replicas' writers)",
        run: Run::Cargo {
            package: "innerwall-control-plane",
            target: "heartbeats",
            full: &[],
            quick: &[("INNERWALL_BENCH_QUICK", "1")],
        },
    },
];

pub fn run(root: &Path, names: &[String], quick: bool) -> Result<()> {
    let unknown: Vec<&String> = names.iter().filter(|n| !BENCHES.iter().any(|b| b.name == *n)).collect();
    if !unknown.is_empty() {
        let known: Vec<&str> = BENCHES.iter().map(|b| b.name).collect();
        bail!("unknown benchmark(s) {unknown:?}; they are: {}", known.join(", "));
    }
    let chosen: Vec<&Bench> =
        BENCHES.iter().filter(|b| names.is_empty() || names.contains(&b.name.to_owned())).collect();
    setup::apt_packages()?;
    let object = ebpf::build(root)?;
    // Full runs: release (`cargo bench`'s own profile), each package's own features. Quick
    // runs: what the tests built.
    let (profile, selection, profile_dir): (&[&str], &[&str], &str) = if quick {
        (&["--profile", "test"], &["--workspace"], "debug")
    } else {
        (&["--release"], &["-p", "innerwall-e2e", "-p", "innerwall-control-plane"], "release")
    };
    if chosen.iter().any(|b| matches!(b.run, Run::Loadgen { .. })) {
        cmd::run(cmd::root_cargo(root).arg("build").args(profile).args(selection).args([
            "--bin",
            "innerwall-loadgen",
            "--bin",
            "innerwall",
        ]))?;
        // The real agent of `propagation --real-agent`, beside the load generator.
        cmd::run(cmd::root_cargo(root).arg("build").args(profile).args([
            "-p",
            "innerwall-agent",
            "--bin",
            "innerwall-agent",
        ]))?;
    }
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    let commit = commit(root);
    let mut figures = Vec::new();
    let mut failures = Vec::new();
    for bench in &chosen {
        println!("\n=== {} ({}){}", bench.name, bench.what, if quick { ", quick" } else { "" });
        let before = leftovers::scan();
        let mut command = match &bench.run {
            Run::Cargo { package, target, full, quick: small } => {
                let mut c = cmd::root_cargo(root);
                c.arg("bench");
                if quick {
                    c.args(profile).args(selection).envs(small.iter().copied());
                } else {
                    c.args(["-p", package]).envs(full.iter().copied());
                }
                c.args(["--bench", target]);
                c
            }
            Run::Loadgen { full, quick: small } => {
                let mut c = Command::new(target_dir(root).join(profile_dir).join("innerwall-loadgen"));
                c.args(if quick { *small } else { *full });
                c
            }
        };
        command.env(OBJECT_ENV, &object);
        // A benchmark that fails is reported at the end: the others' figures of a long run
        // still count.
        let found = run_collecting(&mut command);
        if let Err(e) = leftovers::check(&before, &format!("benchmark {}", bench.name)) {
            failures.push(format!("{e:#}"));
        }
        let found = match found {
            Ok(found) => found,
            Err(e) => {
                failures.push(format!("benchmark {}: {e:#}", bench.name));
                continue;
            }
        };
        if found.is_empty() {
            failures.push(format!("benchmark {} printed no FIGURE line", bench.name));
        }
        figures.extend(found.into_iter().map(|mut f| {
            f["bench"] = json!(bench.name);
            f
        }));
    }
    println!(
        "\n=== figures ({cores} cores, commit {commit}{})",
        if quick { ", --quick: sizes too small to judge" } else { "" }
    );
    let mut missed = 0;
    for f in &figures {
        let verdict = match (&f["goal"], quick) {
            (Value::Null, _) => String::new(),
            (goal, true) => format!("  (goal {})", goal_text(goal)),
            (goal, false) => {
                let met = meets(f["value"].as_f64().unwrap_or(f64::NAN), goal);
                missed += usize::from(!met);
                format!("  goal {}: {}", goal_text(goal), if met { "met" } else { "MISSED" })
            }
        };
        println!(
            "{} {}: {} {}{verdict}  {}",
            f["id"].as_str().unwrap_or("?"),
            f["name"].as_str().unwrap_or("?"),
            shown(f["value"].as_f64().unwrap_or(f64::NAN)),
            f["unit"].as_str().unwrap_or(""),
            f["context"]
        );
    }
    let report = json!({
        "commit": commit,
        "cores": cores,
        "quick": quick,
        "at_unix": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        "figures": figures,
    });
    let dir = target_dir(root).join("bench");
    std::fs::create_dir_all(&dir)?;
    let file = dir.join(format!("bench-{}.json", report["at_unix"]));
    let text = serde_json::to_string_pretty(&report)?;
    std::fs::write(&file, &text)?;
    std::fs::write(dir.join("latest.json"), &text)?;
    std::fs::write(dir.join("latest.md"), table(&figures, &commit, cores, quick))?;
    println!("wrote {} and latest.md, its table ({} figures)", file.display(), figures.len());
    if !quick && missed > 0 {
        println!("{missed} goal(s) missed");
    }
    if !failures.is_empty() {
        bail!("{} benchmark(s) failed:\n{}", failures.len(), failures.join("\n"));
    }
    Ok(())
}

/// Runs `command` with its output passed through, and returns the figures it printed.
fn run_collecting(command: &mut Command) -> Result<Vec<Value>> {
    println!("$ {}", cmd::describe(command));
    let mut child = command.stdout(Stdio::piped()).spawn().with_context(|| cmd::describe(command))?;
    let mut figures = Vec::new();
    for line in BufReader::new(child.stdout.take().context("piped stdout")?).lines() {
        let line = line?;
        println!("{line}");
        if let Some(json) = line.strip_prefix("FIGURE ") {
            figures.push(
                serde_json::from_str::<Value>(json).with_context(|| format!("malformed figure: {json}"))?,
            );
        }
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("{} failed ({status})", cmd::describe(command));
    }
    Ok(figures)
}

fn meets(value: f64, goal: &Value) -> bool {
    let bound = goal["bound"].as_f64().unwrap_or(f64::NAN);
    match goal["op"].as_str() {
        Some("<") => value < bound,
        Some("<=") => value <= bound,
        Some(">") => value > bound,
        Some(">=") => value >= bound,
        _ => false,
    }
}

/// A goal as written: `< 400`.
fn goal_text(goal: &Value) -> String {
    format!("{} {}", goal["op"].as_str().unwrap_or("?"), goal["bound"])
}

/// The run's figures as one Markdown table, in the order they ran, for BENCHMARKS.md: benchmark,
/// requirement, figure, value with its unit, goal, and whether the run met it.
fn table(figures: &[Value], commit: &str, cores: usize, quick: bool) -> String {
    let mut out = format!(
        "`cargo xtask bench{}` at `{commit}`, {cores} cores\n\n| bench | id | figure | value | goal | |\n|---|---|---|---|---|---|\n",
        if quick { " --quick" } else { "" }
    );
    for f in figures {
        let value = f["value"].as_f64().unwrap_or(f64::NAN);
        let (goal, verdict) = match &f["goal"] {
            Value::Null => (String::new(), ""),
            _ if quick => (goal_text(&f["goal"]), ""),
            goal => (goal_text(goal), if meets(value, goal) { "met" } else { "**missed**" }),
        };
        let context: Vec<String> = f["context"]
            .as_object()
            .map(|c| {
                c.iter()
                    .map(|(k, v)| format!("{k} {}", v.as_str().map_or_else(|| v.to_string(), str::to_owned)))
                    .collect()
            })
            .unwrap_or_default();
        let name = match context.is_empty() {
            true => f["name"].as_str().unwrap_or("?").to_owned(),
            false => format!("{} ({})", f["name"].as_str().unwrap_or("?"), context.join(", ")),
        };
        let value = format!("{} {}", shown(value), f["unit"].as_str().unwrap_or(""));
        out.push_str(&format!(
            "| {} | {} | {name} | {} | {goal} | {verdict} |\n",
            f["bench"].as_str().unwrap_or("?"),
            f["id"].as_str().unwrap_or("?"),
            value.trim_end(),
        ));
    }
    out
}

/// A figure as people read it: thousands separated, one decimal below 100.
fn shown(value: f64) -> String {
    if value.abs() >= 100.0 {
        let digits = format!("{:.0}", value.abs());
        let mut out = String::new();
        for (i, c) in digits.chars().enumerate() {
            if i > 0 && (digits.len() - i) % 3 == 0 {
                out.push(',');
            }
            out.push(c);
        }
        if value < 0.0 { format!("-{out}") } else { out }
    } else if value.abs() >= 1.0 || value == 0.0 {
        format!("{value:.1}")
    } else {
        // Below one (cores, say): three decimals, not a rounded 0.0.
        format!("{value:.3}")
    }
}

/// Where cargo builds: `CARGO_TARGET_DIR`, else `<root>/target`.
fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from)
}

/// The commit benchmarked, `+dirty` when the tree has changes.
fn commit(root: &Path) -> String {
    let git = |args: &[&str]| cmd::output(Command::new("git").current_dir(root).args(args));
    let head =
        git(&["rev-parse", "--short=10", "HEAD"]).map_or_else(|_| "unknown".into(), |s| s.trim().to_owned());
    let dirty = git(&["status", "--porcelain"]).is_ok_and(|s| !s.trim().is_empty());
    if dirty { format!("{head}+dirty") } else { head }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_read_and_judge_as_written() {
        assert_eq!(shown(112_836.4), "112,836");
        assert_eq!(shown(89.94), "89.9");
        assert_eq!(shown(-1234.0), "-1,234");
        assert_eq!(shown(0.0694), "0.069");
        assert_eq!(shown(0.0), "0.0");
        assert!(meets(19.3, &json!({"op": "<", "bound": 250.0})));
        assert!(!meets(250.0, &json!({"op": "<", "bound": 250.0})));
        assert!(meets(0.0, &json!({"op": "<=", "bound": 0.0})));
        assert!(!meets(9_999.0, &json!({"op": ">=", "bound": 10_000.0})));
        assert!(!meets(1.0, &json!({"op": "~", "bound": 1.0})), "an unknown goal is never met");
    }

    #[test]
    fn the_table_has_a_row_a_figure_with_its_verdict() {
        let figures = [
            json!({"bench": "enroll", "id": "PERF-3", "name": "enrollments per second", "value": 785.9,
                   "unit": "enrollments/s", "goal": {"op": ">=", "bound": 800.0}, "context": {"agents": 10000}}),
            json!({"bench": "nft", "id": "PERF-5", "name": "full replace", "value": 88.48, "unit": "ms",
                   "goal": {"op": "<", "bound": 500}, "context": {}}),
            json!({"bench": "nft", "id": "PERF-5", "name": "rules", "value": 200.0, "unit": "", "goal": null}),
        ];
        let full = table(&figures, "abc1234", 2, false);
        let rows: Vec<&str> =
            full.lines().filter(|l| l.starts_with("| ") && !l.starts_with("| bench")).collect();
        assert_eq!(
            rows,
            [
                "| enroll | PERF-3 | enrollments per second (agents 10000) | 786 enrollments/s | >= 800.0 | **missed** |",
                "| nft | PERF-5 | full replace | 88.5 ms | < 500 | met |",
                "| nft | PERF-5 | rules | 200 |  |  |",
            ]
        );
        assert!(full.starts_with("`cargo xtask bench` at `abc1234`, 2 cores"), "{full}");
        assert!(!table(&figures, "abc1234", 2, true).contains("missed"), "quick sizes are not judged");
    }

    #[test]
    fn every_benchmark_name_is_unique() {
        let mut names: Vec<&str> = BENCHES.iter().map(|b| b.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), BENCHES.len());
    }
}
