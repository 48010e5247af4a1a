//! Telemetry upload (FLOW-4, SYNC-10): closed windows wait in a bounded on-disk queue and
//! travel on their own mutually authenticated connection with their own backoff, so flow
//! uploads never queue behind or take down policy. The control plane stores a window once per
//! (workload, window id), so a retried upload never counts twice. When the queue is full the
//! oldest window is dropped and recorded as an UPLOAD_BUFFER_OVERFLOW gap on the newest.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use innerwall_wire::backoff;
use innerwall_wire::flows::{EvidenceGap, FlowWindow, GapKind};
use innerwall_wire::proto;
use prost::Message;

use crate::connect::{RunConfig, connect};
use crate::error;

/// Default bound of the on-disk queue, in windows.
pub const DEFAULT_MAX_WINDOWS: usize = 1_440;

#[derive(Debug, Clone)]
pub struct Queue {
    dir: PathBuf,
    max_windows: usize,
}

impl Queue {
    pub fn new(state_dir: &Path, max_windows: usize) -> std::io::Result<Queue> {
        let dir = state_dir.join("telemetry");
        fs::create_dir_all(&dir)?;
        Ok(Queue { dir, max_windows: max_windows.max(1) })
    }

    /// Queued files, oldest first.
    fn files(&self) -> std::io::Result<Vec<PathBuf>> {
        let mut files: Vec<PathBuf> = fs::read_dir(&self.dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "window"))
            .collect();
        files.sort();
        Ok(files)
    }

    pub fn len(&self) -> usize {
        self.files().map_or(0, |f| f.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Writes a closed window durably (temp file, fsync, rename), dropping the oldest windows
    /// beyond the bound and recording each as a gap on this one.
    pub fn push(&self, mut window: FlowWindow) -> std::io::Result<()> {
        let files = self.files()?;
        let excess = (files.len() + 1).saturating_sub(self.max_windows);
        for old in files.iter().take(excess) {
            if let Ok(dropped) =
                fs::read(old).map_err(drop).and_then(|b| proto::FlowWindow::decode(&b[..]).map_err(drop))
            {
                window.gaps.push(EvidenceGap {
                    kind: GapKind::UploadBufferOverflow,
                    from_ms: dropped.start_unix_ms,
                    to_ms: dropped.end_unix_ms,
                    count: dropped.records.len() as u64,
                });
            }
            fs::remove_file(old)?;
            tracing::warn!("telemetry queue full: dropped the oldest window, recorded as a gap");
        }
        let seq =
            files.last().and_then(|p| p.file_stem()?.to_str()?.parse::<u64>().ok()).map_or(0, |n| n + 1);
        let path = self.dir.join(format!("{seq:020}.window"));
        let tmp = path.with_extension("tmp");
        let mut file = fs::File::create(&tmp)?;
        std::io::Write::write_all(&mut file, &proto::FlowWindow::from(&window).encode_to_vec())?;
        file.sync_all()?;
        fs::rename(&tmp, &path)?;
        fs::File::open(&self.dir)?.sync_all()
    }

    /// Uploads queued windows oldest first; each is removed only once the control plane has
    /// stored it (or already had it). Returns how many were delivered.
    pub async fn upload(&self, channel: tonic::transport::Channel) -> Result<usize, tonic::Status> {
        let mut client = proto::telemetry_service_client::TelemetryServiceClient::new(channel);
        let mut sent = 0;
        for path in self.files().map_err(|e| tonic::Status::internal(e.to_string()))? {
            let Ok(bytes) = fs::read(&path) else { continue };
            let Ok(window) = proto::FlowWindow::decode(&bytes[..]) else {
                tracing::error!(path = %path.display(), "dropping an unreadable queued window");
                let _ = fs::remove_file(&path);
                continue;
            };
            match client.report_flows(proto::ReportFlowsRequest { window: Some(window) }).await {
                Ok(_) => {
                    let _ = fs::remove_file(&path);
                    sent += 1;
                }
                Err(s) if s.code() == tonic::Code::InvalidArgument => {
                    // Retrying a window the control plane refuses would block the queue forever.
                    tracing::error!(path = %path.display(), "control plane refused a window: {}", s.message());
                    let _ = fs::remove_file(&path);
                }
                Err(s) => return Err(s),
            }
        }
        Ok(sent)
    }
}

/// Drains the queue forever on its own connection, with its own full-jitter backoff.
pub async fn upload_forever(config: RunConfig, queue: Queue, poll: Duration) {
    let mut attempt: u32 = 0;
    loop {
        if !queue.is_empty() {
            let result = match connect(&config).await {
                Ok(channel) => queue.upload(channel).await.map_err(|s| s.message().to_owned()),
                Err(e) => Err(error::chain(&e)),
            };
            match result {
                Ok(_) => attempt = 0,
                Err(e) => {
                    let wait = backoff::wait(
                        attempt,
                        config.backoff_base,
                        config.backoff_cap,
                        backoff::random_unit(),
                    );
                    attempt = attempt.saturating_add(1);
                    tracing::warn!(
                        "flow upload failed: {e}; {} window(s) queued; retrying in {:.3}s",
                        queue.len(),
                        wait.as_secs_f64()
                    );
                    tokio::time::sleep(wait).await;
                    continue;
                }
            }
        }
        tokio::time::sleep(poll).await;
    }
}
