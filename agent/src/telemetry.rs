//! Telemetry upload (FLOW-4, SYNC-10): closed windows wait in a bounded on-disk queue and
//! travel on their own mutually authenticated connection with their own backoff, so flow
//! uploads never queue behind or take down policy. The control plane stores a window once per
//! (workload, window id), so a retried upload never counts twice. When the queue is full the
//! oldest window is dropped and recorded as an UPLOAD_BUFFER_OVERFLOW gap on the newest. A
//! window the control plane refuses (e.g. its times are outside what it accepts) is not retried
//! and not dropped silently: it becomes an UPLOAD_REFUSED gap on the next window queued.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use innerwall_wire::backoff;
use innerwall_wire::flows::{EvidenceGap, FlowWindow, GapKind};
use innerwall_wire::proto;
use prost::Message;

use crate::connect::{RunConfig, connect};
use crate::{error, private};

/// Default bound of the on-disk queue, in windows.
pub const DEFAULT_MAX_WINDOWS: usize = 1_440;

/// The refused windows not yet reported, as one gap: `<from_ms> <to_ms> <count>`.
const REFUSED_FILE: &str = "refused.gap";

#[derive(Debug, Clone)]
pub struct Queue {
    dir: PathBuf,
    max_windows: usize,
}

impl Queue {
    pub fn new(state_dir: &Path, max_windows: usize) -> std::io::Result<Queue> {
        let dir = state_dir.join("telemetry");
        private::dir(&dir)?;
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
        let refused = self.refused();
        window.gaps.extend(refused);
        // However many gaps piled up, the window stays acceptable and every one is counted.
        window.gaps = innerwall_wire::flows::bound_gaps(std::mem::take(&mut window.gaps));
        let seq =
            files.last().and_then(|p| p.file_stem()?.to_str()?.parse::<u64>().ok()).map_or(0, |n| n + 1);
        let path = self.dir.join(format!("{seq:020}.window"));
        private::write(&path, &proto::FlowWindow::from(&window).encode_to_vec())?;
        if refused.is_some() {
            // A crash before this line reports the refused windows twice, never not at all.
            fs::remove_file(self.dir.join(REFUSED_FILE))?;
        }
        Ok(())
    }

    /// The refused windows not yet reported on a queued window, as one gap.
    fn refused(&self) -> Option<EvidenceGap> {
        let text = fs::read_to_string(self.dir.join(REFUSED_FILE)).ok()?;
        let mut fields = text.split_whitespace().map(str::parse::<i64>);
        match (fields.next(), fields.next(), fields.next()) {
            (Some(Ok(from_ms)), Some(Ok(to_ms)), Some(Ok(count))) => {
                Some(EvidenceGap { kind: GapKind::UploadRefused, from_ms, to_ms, count: count.max(0) as u64 })
            }
            _ => {
                tracing::error!("unreadable {REFUSED_FILE}: {text:?}; its refused windows are not reported");
                None
            }
        }
    }

    /// Adds a refused window's gap ([`refused_gap`]) to the UPLOAD_REFUSED gap the next queued
    /// window carries, so nothing refused is lost however often it happens.
    fn note_refused(&self, mut gap: EvidenceGap) -> std::io::Result<()> {
        if let Some(earlier) = self.refused() {
            gap.from_ms = gap.from_ms.min(earlier.from_ms);
            gap.to_ms = gap.to_ms.max(earlier.to_ms);
            gap.count = gap.count.saturating_add(earlier.count);
        }
        let text = format!("{} {} {}\n", gap.from_ms, gap.to_ms, gap.count);
        private::write(&self.dir.join(REFUSED_FILE), text.as_bytes())
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
            let if_refused = refused_gap(&window);
            match client.report_flows(proto::ReportFlowsRequest { window: Some(window) }).await {
                Ok(_) => {
                    let _ = fs::remove_file(&path);
                    sent += 1;
                }
                Err(s) if !retryable(s.code()) => {
                    // Retrying a window the control plane refuses would block the queue forever;
                    // it becomes a gap on the next window instead.
                    tracing::error!(path = %path.display(), "control plane refused a window: {}", s.message());
                    self.note_refused(if_refused).map_err(|e| tonic::Status::internal(e.to_string()))?;
                    let _ = fs::remove_file(&path);
                }
                Err(s) => return Err(s),
            }
        }
        Ok(sent)
    }
}

/// Whether an upload answered with `code` can succeed later as it is. The window itself is
/// refused (invalid, too large, not acceptable in the server's state for it): retrying would
/// block every later window, so it becomes a gap. The control plane or the connection is in
/// trouble (unavailable, overloaded, an internal error, a credential being renewed, an identity
/// being refused): the window waits and is sent again.
fn retryable(code: tonic::Code) -> bool {
    use tonic::Code;
    !matches!(
        code,
        Code::InvalidArgument
            | Code::OutOfRange
            | Code::FailedPrecondition
            | Code::NotFound
            | Code::AlreadyExists
            | Code::Unimplemented
            | Code::DataLoss
    )
}

/// The gap a window leaves if the control plane refuses it: its interval spans the window and
/// its own gaps, its count is the window's records plus the refused windows it was carrying.
fn refused_gap(window: &proto::FlowWindow) -> EvidenceGap {
    let carried = window
        .gaps
        .iter()
        .filter(|g| EvidenceGap::try_from(*g).is_ok_and(|g| g.kind == GapKind::UploadRefused))
        .map(|g| g.count);
    EvidenceGap {
        kind: GapKind::UploadRefused,
        from_ms: window.gaps.iter().map(|g| g.from_unix_ms).fold(window.start_unix_ms, i64::min),
        to_ms: window.gaps.iter().map(|g| g.to_unix_ms).fold(window.end_unix_ms, i64::max),
        count: (window.records.len() as u64).saturating_add(carried.sum()),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_window_never_blocks_the_queue_a_passing_trouble_does_not_lose_it() {
        use tonic::Code;
        for refused in
            [Code::InvalidArgument, Code::OutOfRange, Code::FailedPrecondition, Code::Unimplemented]
        {
            assert!(!retryable(refused), "{refused:?} would be retried forever");
        }
        for trouble in [
            Code::Unavailable,
            Code::DeadlineExceeded,
            Code::ResourceExhausted,
            Code::Internal,
            Code::Unauthenticated,
            Code::PermissionDenied,
        ] {
            assert!(retryable(trouble), "{trouble:?} would drop a window that could still be delivered");
        }
    }
}
