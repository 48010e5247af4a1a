//! A control-plane replica under load: a real `innerwall serve` process on loopback, with its
//! metrics listener, which the load generator kills, restarts and samples (CPU, RSS, metrics).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub use innerwall_control_plane::testing::usage::{Usage, machine_busy_secs};

/// How a replica is started; kept so it can be started again on the same ports.
#[derive(Debug, Clone)]
pub struct ReplicaConfig {
    pub bin: PathBuf,
    pub database_url: String,
    pub ca_dir: PathBuf,
    pub heartbeat: Duration,
    /// Where its stderr goes (appended across restarts).
    pub log: PathBuf,
}

#[derive(Debug)]
pub struct Replica {
    config: ReplicaConfig,
    child: Child,
    pub port: u16,
    pub metrics_port: u16,
}

impl Replica {
    /// Starts `innerwall serve` on free loopback ports and waits until both listeners answer.
    pub async fn start(config: &ReplicaConfig) -> anyhow::Result<Replica> {
        let (port, metrics_port) = (free_port()?, free_port()?);
        let child = spawn(config, port, metrics_port)?;
        let replica = Replica { config: config.clone(), child, port, metrics_port };
        replica.wait_ready().await?;
        Ok(replica)
    }

    pub fn server(&self) -> String {
        format!("localhost:{}", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, as a crash or an OOM kill would end it: no drain, streams cut.
    pub fn kill(&mut self) -> anyhow::Result<()> {
        self.child.kill().context("killing the replica")?;
        self.child.wait().context("reaping the replica")?;
        Ok(())
    }

    /// Starts it again on the same ports, once the old process is gone.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.child = spawn(&self.config, self.port, self.metrics_port)?;
        self.wait_ready().await
    }

    /// Polls until `/metrics` answers and the agent port accepts (30 s at most).
    async fn wait_ready(&self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let agent_port = tokio::net::TcpStream::connect(("127.0.0.1", self.port)).await.is_ok();
            if agent_port && self.metrics().await.is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("innerwall serve never became ready; its log: {}", tail(&self.config.log));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The replica's `/metrics` page.
    pub async fn metrics(&self) -> anyhow::Result<String> {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", self.metrics_port)).await?;
        stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n").await?;
        let mut text = String::new();
        stream.read_to_string(&mut text).await?;
        match text.split_once("\r\n\r\n") {
            Some((head, body)) if head.starts_with("HTTP/1.1 200") || head.starts_with("HTTP/1.0 200") => {
                Ok(body.to_owned())
            }
            _ => bail!("/metrics answered: {}", text.lines().next().unwrap_or_default()),
        }
    }

    /// One sample of a metric without labels (or the sum over its labelled series).
    pub async fn metric(&self, name: &str) -> anyhow::Result<f64> {
        Ok(sample(&self.metrics().await?, name))
    }

    /// One labelled series of a metric, e.g. (`innerwall_acks_total`, `status="FAILED"`).
    pub async fn metric_labeled(&self, name: &str, label: &str) -> anyhow::Result<f64> {
        let page = self.metrics().await?;
        let series = format!("{name}{{{label}}}");
        Ok(page
            .lines()
            .filter_map(|l| l.rsplit_once(' '))
            .filter(|(s, _)| *s == series)
            .filter_map(|(_, v)| v.parse::<f64>().ok())
            .sum())
    }

    /// The process's CPU time so far and its resident set now.
    pub fn usage(&self) -> anyhow::Result<Usage> {
        Usage::of(self.pid())
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(config: &ReplicaConfig, port: u16, metrics_port: u16) -> anyhow::Result<Child> {
    let log = std::fs::OpenOptions::new().create(true).append(true).open(&config.log)?;
    let heartbeat = format!("{}s", config.heartbeat.as_secs().max(1));
    Command::new(&config.bin)
        .args(["--database-url", &config.database_url, "--ca-dir"])
        .arg(&config.ca_dir)
        .args(["serve", "--server-name", "localhost", "--heartbeat-interval", &heartbeat])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--metrics-listen", &format!("127.0.0.1:{metrics_port}")])
        // Every simulated agent dials from 127.0.0.1: the per-source bound is for hosts, not for
        // a load generator standing in for thousands of them.
        .args(["--max-connections-per-source", "1000000"])
        .env("INNERWALL_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .with_context(|| format!("spawning {}", config.bin.display()))
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The last lines of a log file, for an error message.
pub fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// The value of `name` in a Prometheus text page: the sum of its series (0 when absent).
pub fn sample(page: &str, name: &str) -> f64 {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let metric = series.split('{').next()?;
            (metric == name).then(|| value.parse::<f64>().ok())?
        })
        .sum()
}

/// Samples the replicas' CPU and peak RSS while a measured phase runs.
#[derive(Debug)]
pub struct Sampler {
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<(f64, u64)>,
    started: Instant,
    cpu_before: f64,
}

impl Sampler {
    pub fn start(pids: Vec<u32>) -> Sampler {
        let cpu_before = pids.iter().filter_map(|p| Usage::of(*p).ok()).map(|u| u.cpu_secs).sum();
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(async move {
            let mut peak_rss = 0u64;
            loop {
                let usage: Vec<Usage> = pids.iter().filter_map(|p| Usage::of(*p).ok()).collect();
                peak_rss = peak_rss.max(usage.iter().map(|u| u.rss_kib).sum());
                let cpu = usage.iter().map(|u| u.cpu_secs).sum();
                tokio::select! {
                    _ = stopped.changed() => break (cpu, peak_rss),
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
            }
        });
        Sampler { stop, task, started: Instant::now(), cpu_before }
    }

    /// Stops sampling: the CPU cores the replicas used on average, and their peak RSS (MiB).
    pub async fn finish(self) -> (f64, f64) {
        let wall = self.started.elapsed().as_secs_f64();
        let _ = self.stop.send(true);
        let (cpu, peak_rss) = self.task.await.unwrap_or((self.cpu_before, 0));
        ((cpu - self.cpu_before) / wall.max(1e-3), peak_rss as f64 / 1024.0)
    }
}
