//! Policy files cannot explode (issue 26 item 4): alias bombs of a few KB, handed to the real
//! `innerwall` binary, are refused with the file and line named, the CLI's peak RSS (its
//! `ru_maxrss`, read by `wait4`) stays small, and nothing is written.

use std::io::{Read as _, Write as _};
use std::process::{Command, Stdio};

use innerwall_control_plane::testing::fresh_database;

/// The CLI's peak RSS while it refuses a bomb. A debug build connecting to Postgres peaks near
/// 27 MiB alone, and was seen at 100 MiB, once at 195 MiB, while the whole suite and a benchmark
/// load ran beside it (the runtime's threads and their allocator arenas); a 3 KB bomb took the
/// CLI to 575 MiB before the fix, which this bound still catches.
const PEAK_RSS_BOUND_KIB: i64 = 256 * 1024;

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
    max_rss_kib: i64,
}

/// Runs `innerwall --database-url URL ARGS` with `stdin` and reaps it with `wait4`, for its
/// peak RSS (ru_maxrss, KiB on Linux) of that one child alone.
#[allow(unsafe_code)]
#[allow(clippy::zombie_processes)] // reaped by `wait4`, which `Child::wait` would not let us read
fn innerwall(url: &str, args: &[&str], stdin: &[u8]) -> Run {
    let mut child = Command::new(env!("CARGO_BIN_EXE_innerwall"))
        .arg("--database-url")
        .arg(url)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    let stdin = stdin.to_vec();
    let feeder = std::thread::spawn(move || {
        let _ = input.write_all(&stdin); // the CLI may stop reading early: that is fine
    });
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        out.read_to_string(&mut text).unwrap();
        text
    });
    let mut stderr = String::new();
    err.read_to_string(&mut stderr).unwrap();
    let stdout = reader.join().unwrap();
    feeder.join().unwrap();
    let mut status = 0;
    // SAFETY: a zeroed rusage is a valid value; the pid is our own unreaped child (the `Child`
    // handle is not waited on after this).
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let pid = unsafe { libc::wait4(child.id() as libc::pid_t, &mut status, 0, &mut usage) };
    assert_eq!(pid, child.id() as libc::pid_t, "wait4: {}", std::io::Error::last_os_error());
    assert!(libc::WIFEXITED(status), "the CLI did not exit by itself (status {status:#x}): {stderr}");
    Run { code: libc::WEXITSTATUS(status), stdout, stderr, max_rss_kib: usage.ru_maxrss }
}

/// A valid-looking ruleset whose rules, peers and selectors are aliases of one another: each of
/// `rules` rules has `peers` peers with the same `values`-value selector, so the file stays a
/// few KB while its value has rules × peers × values strings.
fn structural_bomb(rules: usize, peers: usize, values: usize) -> String {
    let vals = vec!["v"; values].join(", ");
    let aliases = vec!["*p"; peers - 1].join(", ");
    let mut text = format!(
        "name: bomb\nscope: {{app: [web]}}\nrules:\n- &r {{name: r, services: [web], peers: [&p {{workloads: {{app: [{vals}]}}}}, {aliases}]}}\n"
    );
    for _ in 1..rules {
        text.push_str("- *r\n");
    }
    text
}

/// The classic one: nine levels of nine aliases to the level below, in the ruleset's scope.
fn nested_bomb(levels: usize, width: usize) -> String {
    let mut text = String::from("name: bomb\nscope:\n  app: &l0 [x]\n");
    for i in 1..levels {
        let refs = vec![format!("*l{}", i - 1); width].join(", ");
        text.push_str(&format!("  k{i}: &l{i} [{refs}]\n"));
    }
    text
}

#[tokio::test]
async fn policy_files_cannot_explode() {
    let db = fresh_database().await.unwrap();
    let dir = std::env::temp_dir().join(format!("iw-bombs-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let created = innerwall(&db.url, &["service", "create", "web", "--entry", "tcp:80"], b"");
    assert_eq!(created.code, 0, "{}", created.stderr);

    let structural = structural_bomb(500, 100, 64);
    let nested = nested_bomb(9, 40);
    let merge = format!(
        "name: bomb\nbase: &b {{app: [web]}}\nscope: {{<<: *b}}\nrules: []\n{}",
        "# padding\n".repeat(200)
    );
    for (name, text) in [("structural.yaml", &structural), ("nested.yaml", &nested), ("merge.yaml", &merge)] {
        assert!((1_000..12_000).contains(&text.len()), "{name} is a few KB: {}", text.len());
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        let path = path.to_string_lossy().into_owned();
        // From a file and from stdin, each twice: the second refusal is the first's.
        for source in [path.as_str(), "-", path.as_str(), "-"] {
            let run = innerwall(&db.url, &["ruleset", "create", "-f", source], text.as_bytes());
            assert_eq!(run.code, 1, "{name} from {source}: {} {}", run.stdout, run.stderr);
            assert!(
                run.stderr.contains(&format!("{source}: line "))
                    && run.stderr.contains("YAML anchors and aliases are not accepted")
                    && run.stderr.contains("write the value out in full"),
                "{name} from {source}: {}",
                run.stderr
            );
            assert!(!run.stderr.contains("panicked"), "{}", run.stderr);
            assert!(
                run.max_rss_kib < PEAK_RSS_BOUND_KIB,
                "{name} from {source}: the CLI peaked at {} KiB, over the {PEAK_RSS_BOUND_KIB} KiB bound",
                run.max_rss_kib
            );
            eprintln!(
                "{name} ({} bytes) from {source}: refused, peak RSS {} KiB",
                text.len(),
                run.max_rss_kib
            );
        }
    }
    // The structural bomb names the first anchor's place exactly.
    let run = innerwall(&db.url, &["ruleset", "create", "-f", "-"], structural.as_bytes());
    assert!(run.stderr.contains("-: line 4 column 3: ") && run.stderr.contains("`&r`"), "{}", run.stderr);

    // Nothing was written; the same ruleset written out in full is taken (and read back).
    let count = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM rulesets").fetch_one(&db.pool).await.unwrap()
    };
    assert_eq!(count().await, 0);
    let plain = "name: plain\nscope: {app: [web]}\nrules:\n- {name: r, services: [web], peers: [{workloads: {app: [v]}}]}\n";
    let run = innerwall(&db.url, &["ruleset", "create", "-f", "-"], plain.as_bytes());
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(run.max_rss_kib < PEAK_RSS_BOUND_KIB, "{} KiB", run.max_rss_kib);
    assert_eq!(count().await, 1);
    std::fs::remove_dir_all(&dir).ok();
}
