//! The demo's processes: starting the control plane, agents and listener in the background
//! with a log and a recorded PID each, running commands with a timeout, and stopping
//! processes by PID only (never by name pattern), leftovers of a killed run included.

use std::{
    fs::{self, File},
    io::Read,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use crate::cmd;

/// The pid file of the `cargo xtask demo` process itself, inside a run's `pids/`.
const XTASK_PID_FILE: &str = "xtask";

pub const POLL: Duration = Duration::from_millis(200);
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
const POSTGRES_STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// The background processes of one run; logs are `DIR/NAME.log`, PIDs `DIR/pids/NAME`.
#[derive(Debug)]
pub struct Processes {
    dir: PathBuf,
    running: Vec<Background>,
}

#[derive(Debug)]
struct Background {
    name: String,
    child: Child,
    log: PathBuf,
}

impl Processes {
    /// Creates `dir/pids` and records this xtask's PID in it: a run whose xtask survived an
    /// interrupt (SIGINT ignored) must be stopped before the next one takes over the names, or
    /// its guard would later tear down the new network.
    pub fn new(dir: &Path) -> Result<Self> {
        fs::create_dir(dir.join("pids")).context("while creating the pid directory")?;
        fs::write(dir.join("pids").join(XTASK_PID_FILE), std::process::id().to_string())
            .context("while recording the xtask pid")?;
        Ok(Self { dir: dir.to_owned(), running: Vec::new() })
    }

    /// Starts `cmd` with its output in `name`'s log; `shown` is how the command is printed.
    pub fn spawn(&mut self, name: &str, mut cmd: Command, shown: &str) -> Result<()> {
        let log = self.log(name);
        let file = File::create(&log).with_context(|| format!("while creating {}", log.display()))?;
        cmd.stdin(Stdio::null()).stdout(file.try_clone()?).stderr(file);
        println!("  $ {shown} >$DEMO/{name}.log 2>&1 &");
        let child = cmd.spawn().with_context(|| format!("could not start `{shown}`"))?;
        // Recorded so a later run can stop it if this one is killed before its guard runs.
        fs::write(self.dir.join("pids").join(name), child.id().to_string())
            .context("while recording a pid")?;
        self.running.push(Background { name: name.to_owned(), child, log });
        Ok(())
    }

    pub fn log(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.log"))
    }

    /// Waits until `name`'s log has a line containing `needle`; fails early if it exits.
    pub fn wait_for_log(&mut self, name: &str, needle: &str, timeout: Duration) -> Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let log = self.log(name);
            let text = fs::read_to_string(&log).unwrap_or_default();
            if let Some(line) = text.lines().find(|line| line.contains(needle)) {
                return Ok(line.to_owned());
            }
            let proc = self.running.iter_mut().find(|proc| proc.name == name);
            if let Some(proc) = proc
                && let Some(status) = proc.child.try_wait()?
            {
                bail!("{name} exited ({status}) before printing {needle:?}{}", self.log_tail(name));
            }
            if Instant::now() > deadline {
                bail!("{name} did not print {needle:?} within {timeout:?}{}", self.log_tail(name));
            }
            thread::sleep(POLL);
        }
    }

    /// The last lines of `name`'s log, as a paragraph to append to an error.
    pub fn log_tail(&self, name: &str) -> String {
        let log = self.log(name);
        let text = fs::read_to_string(&log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = lines[lines.len().saturating_sub(15)..].join("\n    ");
        format!("\n  last lines of {}:\n    {tail}", log.display())
    }

    /// Stops every process, the last started first, printing how each ended.
    pub fn stop_all(&mut self) {
        for proc in self.running.iter_mut().rev() {
            match stop_child(&mut proc.child) {
                Ok(how) => println!("  {}: {how}", proc.name),
                Err(err) => println!("  {}: {err:#} (log: {})", proc.name, proc.log.display()),
            }
        }
    }
}

#[derive(Debug)]
pub struct Captured {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `cmd` to completion with piped output, killing it after `timeout`.
pub fn capture(cmd: &mut Command, timeout: Duration) -> Result<Captured> {
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().context("could not start it (is it installed?)")?;
    let reader = |pipe: Option<Box<dyn Read + Send>>| {
        thread::spawn(move || {
            let mut text = String::new();
            if let Some(mut pipe) = pipe {
                let mut bytes = Vec::new();
                let _ = pipe.read_to_end(&mut bytes);
                text = String::from_utf8_lossy(&bytes).into_owned();
            }
            text
        })
    };
    let stdout = reader(child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let stderr = reader(child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let Some(status) = wait_child(&mut child, timeout)? else {
        let _ = child.kill();
        let _ = child.wait();
        bail!("it did not finish within {timeout:?} and was killed");
    };
    Ok(Captured {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    })
}

fn wait_child(child: &mut Child, timeout: Duration) -> Result<Option<ExitStatus>> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        if Instant::now() > deadline {
            return Ok(None);
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// SIGTERM, a grace period, then SIGKILL; a child that already exited is only reaped, so a
/// recycled PID is never signalled.
fn stop_child(child: &mut Child) -> Result<String> {
    if let Some(status) = child.try_wait()? {
        return Ok(format!("had already exited ({status})"));
    }
    signal(child.id(), "TERM")?;
    if let Some(status) = wait_child(child, STOP_TIMEOUT)? {
        return Ok(format!("stopped (pid {}, {status})", child.id()));
    }
    child.kill().context("while sending SIGKILL")?;
    child.wait()?;
    Ok(format!("killed after {STOP_TIMEOUT:?} (pid {})", child.id()))
}

fn signal(pid: u32, name: &str) -> Result<()> {
    let out = Command::new("kill")
        .args([format!("-{name}"), pid.to_string()])
        .output()
        .context("could not run kill")?;
    if !out.status.success() {
        bail!("kill -{name} {pid}: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// Alive means present in /proc and not a zombie (PID 1 here may never reap orphans).
fn alive(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next()) != Some('Z')
    })
}

fn cmdline(pid: u32) -> String {
    fs::read(format!("/proc/{pid}/cmdline"))
        .map(|bytes| String::from_utf8_lossy(&bytes).replace('\0', " "))
        .unwrap_or_default()
}

/// The command line on one short line, for messages.
fn short_cmdline(pid: u32) -> String {
    let line = cmdline(pid).split_whitespace().collect::<Vec<_>>().join(" ");
    match line.char_indices().nth(100) {
        Some((cut, _)) => format!("{}…", &line[..cut]),
        None => line,
    }
}

fn wait_gone(pid: u32, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while alive(pid) {
        if Instant::now() > deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(50));
    }
    true
}

/// Stops a process that is not our child (a leftover): SIGTERM, grace period, SIGKILL.
fn stop_pid(pid: u32) -> Result<()> {
    if !alive(pid) {
        return Ok(());
    }
    signal(pid, "TERM")?;
    if !wait_gone(pid, STOP_TIMEOUT) {
        signal(pid, "KILL")?;
        wait_gone(pid, Duration::from_secs(2));
    }
    Ok(())
}

/// Stops the xtask of an earlier run recorded in `dir` if it still runs (it was interrupted
/// but ignored SIGINT); says what it stopped.
pub fn stop_interrupted_run(dir: &Path) -> Result<Option<String>> {
    let pid = fs::read_to_string(dir.join("pids").join(XTASK_PID_FILE))
        .ok()
        .and_then(|text| text.trim().parse::<u32>().ok());
    if let Some(pid) = pid
        && pid != std::process::id()
        && alive(pid)
        && cmdline(pid).contains("xtask")
    {
        let found = format!("pid {pid}, the interrupted run itself ({})", short_cmdline(pid));
        stop_pid(pid)?;
        return Ok(Some(found));
    }
    Ok(None)
}

/// Stops every process inside the network namespace `netns`; says what it stopped.
pub fn stop_in_netns(netns: &str) -> Result<Vec<String>> {
    let mut found = Vec::new();
    let pids = cmd::output(Command::new("ip").args(["netns", "pids", netns]))?;
    for pid in pids.lines().filter_map(|line| line.trim().parse::<u32>().ok()) {
        found.push(format!("pid {pid} in {netns} ({})", short_cmdline(pid)));
        stop_pid(pid)?;
    }
    Ok(found)
}

/// Stops the processes an earlier run recorded in `dir/pids`; says what it stopped.
pub fn stop_recorded(dir: &Path) -> Result<Vec<String>> {
    let mut found = Vec::new();
    let dir_text = dir.to_string_lossy();
    for pid_file in fs::read_dir(dir.join("pids")).into_iter().flatten().flatten() {
        let pid = fs::read_to_string(pid_file.path()).ok().and_then(|text| text.trim().parse::<u32>().ok());
        // Only a process whose command line names that directory: a recycled PID is not ours.
        if let Some(pid) = pid
            && alive(pid)
            && cmdline(pid).contains(dir_text.as_ref())
        {
            found.push(format!("pid {pid} ({})", short_cmdline(pid)));
            stop_pid(pid)?;
        }
    }
    Ok(found)
}

/// Stops the embedded cluster `innerwall` started (daemonized by pg_ctl, so not our child) by
/// the PID in its postmaster.pid, checked to be a postgres of this demo directory.
pub fn stop_postgres(dir: &Path) -> Result<Option<String>> {
    let pid_file = dir.join("cp/postgres/data/postmaster.pid");
    let Ok(text) = fs::read_to_string(&pid_file) else {
        return Ok(None);
    };
    let pid: u32 = text
        .lines()
        .next()
        .and_then(|line| line.trim().parse().ok())
        .with_context(|| format!("{} has no pid on its first line", pid_file.display()))?;
    if !alive(pid) || !cmdline(pid).contains(dir.to_string_lossy().as_ref()) {
        return Ok(Some(format!("pid {pid} from postmaster.pid is not running")));
    }
    // SIGINT is PostgreSQL's "fast" shutdown: abort sessions, checkpoint, exit.
    signal(pid, "INT")?;
    if wait_gone(pid, POSTGRES_STOP_TIMEOUT) {
        return Ok(Some(format!("stopped (pid {pid}, fast shutdown)")));
    }
    signal(pid, "QUIT")?;
    if wait_gone(pid, Duration::from_secs(5)) {
        return Ok(Some(format!("pid {pid} needed an immediate shutdown (SIGQUIT)")));
    }
    bail!("postgres pid {pid} is still running after SIGINT and SIGQUIT")
}
