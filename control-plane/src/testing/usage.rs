//! What a process and the machine have used, from `/proc`: for the load generator and the
//! benchmarks that print CPU per operation.

use std::process::Command;

use anyhow::Context;

/// CPU time and memory of a process, from `/proc`.
#[derive(Debug, Clone, Copy)]
pub struct Usage {
    /// User + system CPU seconds so far.
    pub cpu_secs: f64,
    pub rss_kib: u64,
}

impl Usage {
    pub fn of(pid: u32) -> anyhow::Result<Usage> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
        // The fields after the command name, which is in parentheses and may hold spaces.
        let after = stat.rsplit_once(") ").context("malformed /proc/pid/stat")?.1;
        let fields: Vec<&str> = after.split(' ').collect();
        let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
        // utime and stime are fields 14 and 15 of stat, 12 and 13 after the command.
        let cpu_secs = (ticks(11) + ticks(12)) as f64 / clock_ticks() as f64;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        let rss_kib = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .context("no VmRSS in /proc/pid/status")?;
        Ok(Usage { cpu_secs, rss_kib })
    }
}

/// CPU seconds the whole machine has spent busy (every state but idle and iowait) since boot.
pub fn machine_busy_secs() -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let cpu =
        stat.lines().next().and_then(|l| l.strip_prefix("cpu ")).context("no cpu line in /proc/stat")?;
    let ticks: Vec<u64> = cpu.split_whitespace().filter_map(|f| f.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal …; guest time is already in user.
    let busy: u64 =
        ticks.iter().take(8).enumerate().filter(|(i, _)| *i != 3 && *i != 4).map(|(_, t)| t).sum();
    Ok(busy as f64 / clock_ticks() as f64)
}

/// `sysconf(_SC_CLK_TCK)`, asked of `getconf` once (the workspace forbids `unsafe`).
fn clock_ticks() -> u64 {
    static TICKS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(100)
    })
}
