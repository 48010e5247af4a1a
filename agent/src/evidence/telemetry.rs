//! Telemetry upload (FLOW-4, SYNC-10): closed windows wait in a bounded on-disk queue and
//! travel on their own mutually authenticated connection with their own backoff, so flow
//! uploads never queue behind or take down policy. The control plane stores a window once per
//! (workload, window id), so a retried upload never counts twice. When the queue is full the
//! oldest window is dropped and recorded as an UPLOAD_BUFFER_OVERFLOW gap on the newest. A
//! window the control plane refuses (e.g. its times are outside what it accepts) is not retried
//! and not dropped silently: it becomes an UPLOAD_REFUSED gap on the next window queued; one
//! that cannot be read back from the queue becomes a QUEUE_FAILED gap the same way (its
//! interval is in its file name). Such gaps wait in `pending.gaps`, one per kind. A window
//! refused for rate (RESOURCE_EXHAUSTED, REL-1) is not refused as such: it stays queued, and the
//! next attempt waits at least the `retry-after` the control plane named.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use innerwall_wire::backoff;
use innerwall_wire::flows::{EvidenceGap, FlowWindow, GapKind};
use innerwall_wire::proto;
use prost::Message;

use crate::identity::connect::{RunConfig, connect};
use crate::{error, private};

/// Default bound of the on-disk queue, in windows.
pub const DEFAULT_MAX_WINDOWS: usize = 1_440;

/// The gaps of windows lost after they were queued, not yet reported on a queued window: one
/// line per kind, `<kind> <from_ms> <to_ms> <count>`.
const PENDING_FILE: &str = "pending.gaps";

#[derive(Debug, Clone)]
pub struct Queue {
    dir: PathBuf,
    max_windows: usize,
    /// Held while the pending gaps are read and written: the window task reports them on the
    /// window it queues and removes the file while the uploader adds a refused window's gap to
    /// it; interleaved, a gap was removed unreported, or reported twice.
    pending_file: std::sync::Arc<std::sync::Mutex<()>>,
}

impl Queue {
    pub fn new(state_dir: &Path, max_windows: usize) -> std::io::Result<Queue> {
        let dir = state_dir.join("telemetry");
        private::dir(&dir)?;
        Ok(Queue { dir, max_windows: max_windows.max(1), pending_file: Default::default() })
    }

    /// Queued files, oldest first. Each is named `<seq>-<start_ms>-<end_ms>.window`.
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
                let (from_ms, to_ms) = (dropped.start_unix_ms, dropped.end_unix_ms);
                let records = dropped.records.len() as u64;
                window.gaps.push(EvidenceGap::new(GapKind::UploadBufferOverflow, from_ms, to_ms, records));
            }
            fs::remove_file(old)?;
            tracing::warn!("telemetry queue full: dropped the oldest window, recorded as a gap");
        }
        let _pending_file = self.lock_pending();
        let pending = self.pending();
        let reported = !pending.is_empty();
        window.gaps.extend(pending);
        // However many gaps piled up, the window stays acceptable and every one is counted.
        window.gaps = innerwall_wire::flows::bound_gaps(std::mem::take(&mut window.gaps));
        let seq = files.last().and_then(|p| sequence(p)).map_or(0, |n| n + 1);
        let path = self.dir.join(format!("{seq:020}-{}-{}.window", window.start_ms, window.end_ms));
        private::write(&path, &proto::FlowWindow::from(&window).encode_to_vec())?;
        if reported {
            // A crash before this line reports those gaps twice, never not at all.
            fs::remove_file(self.dir.join(PENDING_FILE))?;
        }
        Ok(())
    }

    fn lock_pending(&self) -> std::sync::MutexGuard<'_, ()> {
        self.pending_file.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The gaps of lost windows not yet reported on a queued window, one per kind. A line is
    /// `<kind> <from_ms> <to_ms> <count> <detail>` (the detail to the end of the line).
    fn pending(&self) -> Vec<EvidenceGap> {
        let Ok(text) = fs::read_to_string(self.dir.join(PENDING_FILE)) else { return Vec::new() };
        text.lines()
            .filter_map(|line| {
                let parsed = parse_gap(line);
                if parsed.is_none() {
                    tracing::error!(
                        "unreadable line in {PENDING_FILE}: {line:?}; those lost windows are not reported"
                    );
                }
                parsed
            })
            .collect()
    }

    /// Adds a lost window's gap ([`lost`]) to the gap of its kind the next queued window
    /// carries, so nothing lost goes unreported however often it happens.
    fn note(&self, gap: EvidenceGap) -> std::io::Result<()> {
        let _pending_file = self.lock_pending();
        let mut gaps = self.pending();
        match gaps.iter_mut().find(|g| g.kind == gap.kind) {
            Some(earlier) => earlier.absorb(gap),
            None => gaps.push(gap),
        }
        let line = |g: &EvidenceGap| {
            let detail = g.detail.replace(['\n', '\r'], " ");
            format!("{} {} {} {} {detail}\n", g.kind, g.from_ms, g.to_ms, g.count)
        };
        let text: String = gaps.iter().map(line).collect();
        private::write(&self.dir.join(PENDING_FILE), text.as_bytes())
    }

    /// A queued file that cannot be read back: removed, and reported as a QUEUE_FAILED gap over
    /// the interval its name gives (for a file of an older agent, which named none, the moment
    /// it was written).
    fn unreadable(&self, path: &Path, why: &str) -> std::io::Result<()> {
        tracing::error!(path = %path.display(), "a queued window cannot be read back ({why}); reported as a gap");
        let written = || {
            let at = fs::metadata(path).and_then(|m| m.modified()).ok()?;
            let ms = at.duration_since(std::time::UNIX_EPOCH).ok()?.as_millis() as i64;
            Some((ms, ms))
        };
        let (from_ms, to_ms) = interval(path).or_else(written).unwrap_or_default();
        self.note(EvidenceGap::new(GapKind::QueueFailed, from_ms, to_ms, 0).because(why))?;
        fs::remove_file(path)
    }

    /// Uploads queued windows oldest first; each is removed only once the control plane has
    /// stored it (or already had it). Returns how many were delivered.
    pub async fn upload(&self, channel: tonic::transport::Channel) -> Result<usize, tonic::Status> {
        let mut client = proto::telemetry_service_client::TelemetryServiceClient::new(channel);
        let mut sent = 0;
        let internal = |e: std::io::Error| tonic::Status::internal(e.to_string());
        for path in self.files().map_err(internal)? {
            let window = match fs::read(&path) {
                Ok(bytes) => proto::FlowWindow::decode(&bytes[..]).map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            let window = match window {
                Ok(window) => window,
                Err(why) => {
                    self.unreadable(&path, &why).map_err(internal)?;
                    continue;
                }
            };
            let if_refused = lost(GapKind::UploadRefused, &window);
            match client.report_flows(proto::ReportFlowsRequest { window: Some(window) }).await {
                Ok(_) => {
                    let _ = fs::remove_file(&path);
                    sent += 1;
                }
                Err(s) if !retryable(s.code()) => {
                    // Retrying a window the control plane refuses would block the queue forever;
                    // it becomes a gap on the next window instead.
                    tracing::error!(path = %path.display(), "control plane refused a window: {}", s.message());
                    self.note(if_refused.because(s.message())).map_err(internal)?;
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

/// The gap of `kind` a window leaves when it is lost (refused by the control plane, or not
/// written to the queue): its interval spans the window and its own gaps, its count is the
/// window's records plus those of the lost windows of the same kind it was carrying.
pub fn lost(kind: GapKind, window: &proto::FlowWindow) -> EvidenceGap {
    let carried = window
        .gaps
        .iter()
        .filter(|g| EvidenceGap::try_from(*g).is_ok_and(|g| g.kind == kind))
        .map(|g| g.count);
    EvidenceGap {
        detail: String::new(),
        kind,
        from_ms: window.gaps.iter().map(|g| g.from_unix_ms).fold(window.start_unix_ms, i64::min),
        to_ms: window.gaps.iter().map(|g| g.to_unix_ms).fold(window.end_unix_ms, i64::max),
        count: (window.records.len() as u64).saturating_add(carried.sum()),
    }
}

/// A queued file's sequence number.
fn sequence(path: &Path) -> Option<u64> {
    path.file_stem()?.to_str()?.split('-').next()?.parse().ok()
}

/// The window interval a queued file's name gives.
fn interval(path: &Path) -> Option<(i64, i64)> {
    let stem = path.file_stem()?.to_str()?;
    let mut fields = stem.splitn(3, '-').skip(1).map(str::parse::<i64>);
    Some((fields.next()?.ok()?, fields.next()?.ok()?))
}

/// One line of `pending.gaps`.
fn parse_gap(line: &str) -> Option<EvidenceGap> {
    let mut fields = line.splitn(5, ' ');
    let kind = fields.next()?.parse::<GapKind>().ok()?;
    let mut number = || fields.next()?.parse::<i64>().ok();
    let (from_ms, to_ms, count) = (number()?, number()?, number()?);
    let detail = fields.next().unwrap_or("").trim_end();
    Some(EvidenceGap::new(kind, from_ms, to_ms, count.max(0) as u64).because(detail))
}

/// Drains the queue forever on its own connection, with its own full-jitter backoff, cut short
/// when the policy stream reaches the control plane again (`reachable`): evidence queued while
/// it was away goes up as soon as it is back, not a backoff of up to a minute later.
pub async fn upload_forever(
    config: RunConfig,
    queue: Queue,
    poll: Duration,
    reachable: std::sync::Arc<tokio::sync::Notify>,
) {
    let mut attempt: u32 = 0;
    loop {
        if !queue.is_empty() {
            let result = match connect(&config).await {
                Ok(channel) => queue
                    .upload(channel)
                    .await
                    .map_err(|s| (s.message().to_owned(), backoff::retry_after(&s))),
                Err(e) => Err((error::chain(&e), None)),
            };
            match result {
                Ok(_) => attempt = 0,
                Err((e, retry_after)) => {
                    let wait = config.backoff(attempt, retry_after);
                    attempt = attempt.saturating_add(1);
                    tracing::warn!(
                        "flow upload failed: {e}; {} window(s) queued; retrying in {:.3}s",
                        queue.len(),
                        wait.as_secs_f64()
                    );
                    tokio::select! {
                        () = tokio::time::sleep(wait) => {}
                        () = reachable.notified() => {
                            tracing::info!("the control plane is reachable again: uploading the queued windows now");
                            attempt = 0;
                        }
                    }
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

    /// A window of one second from `start_ms`, without records or gaps.
    fn empty_window(start_ms: i64) -> FlowWindow {
        FlowWindow {
            id: uuid::Uuid::new_v4(),
            start_ms,
            end_ms: start_ms + 1_000,
            policy_version: 1,
            mode: innerwall_wire::policy::Mode::Simulation,
            records: Vec::new(),
            gaps: Vec::new(),
            staged_set: None,
        }
    }

    #[test]
    fn lost_windows_wait_as_one_gap_per_kind_and_queued_names_carry_their_interval() {
        let dir = std::env::temp_dir().join(format!("iw-queue-{}", uuid::Uuid::new_v4()));
        let queue = Queue::new(&dir, 10).unwrap();
        let gap = |kind, from_ms, to_ms, count| EvidenceGap::new(kind, from_ms, to_ms, count);
        queue.note(gap(GapKind::UploadRefused, 5_000, 6_000, 3).because("too old")).unwrap();
        queue.note(gap(GapKind::QueueFailed, 1_000, 2_000, 0).because("bad\nbytes")).unwrap();
        queue.note(gap(GapKind::UploadRefused, 2_000, 3_000, 4)).unwrap();
        assert_eq!(
            queue.pending(),
            [
                gap(GapKind::UploadRefused, 2_000, 6_000, 7).because("too old"),
                gap(GapKind::QueueFailed, 1_000, 2_000, 0).because("bad bytes")
            ]
        );
        queue.push(empty_window(10_000)).unwrap();
        assert!(queue.pending().is_empty(), "reported on the window just queued");
        queue.push(empty_window(11_000)).unwrap();
        let files = queue.files().unwrap();
        assert_eq!(
            files.iter().map(|f| (sequence(f), interval(f))).collect::<Vec<_>>(),
            [(Some(0), Some((10_000, 11_000))), (Some(1), Some((11_000, 12_000)))]
        );
        let first = proto::FlowWindow::decode(&fs::read(&files[0]).unwrap()[..]).unwrap();
        assert_eq!(first.gaps.len(), 2);
        // A file that cannot be read back is a QUEUE_FAILED gap over the interval in its name.
        queue.unreadable(&files[1], "test").unwrap();
        assert_eq!(queue.pending(), [gap(GapKind::QueueFailed, 11_000, 12_000, 0).because("test")]);
        assert_eq!(queue.len(), 1);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// The window task queues windows (reporting the pending gaps on each) while the uploader
    /// notes refused windows: every refused record is reported once, on a queued window or still
    /// pending, however the two interleave.
    #[test]
    fn gaps_noted_while_windows_are_queued_are_never_lost() {
        let dir = std::env::temp_dir().join(format!("iw-queue-{}", uuid::Uuid::new_v4()));
        let queue = Queue::new(&dir, 1_000).unwrap();
        const NOTES: u64 = 150;
        let noting = std::thread::spawn({
            let queue = queue.clone();
            move || {
                for i in 0..NOTES as i64 {
                    queue.note(EvidenceGap::new(GapKind::UploadRefused, i, i + 1, 1)).unwrap();
                }
            }
        });
        let mut start_ms = 0;
        while !noting.is_finished() {
            start_ms += 1_000;
            queue.push(empty_window(start_ms)).unwrap();
        }
        noting.join().unwrap();
        let queued: u64 = queue
            .files()
            .unwrap()
            .iter()
            .flat_map(|f| proto::FlowWindow::decode(&fs::read(f).unwrap()[..]).unwrap().gaps)
            .map(|g| g.count)
            .sum();
        let pending: u64 = queue.pending().iter().map(|g| g.count).sum();
        assert!(start_ms > 1_000, "windows were queued while gaps were noted");
        assert_eq!(queued + pending, NOTES, "{queued} reported on windows, {pending} pending");
        fs::remove_dir_all(&dir).unwrap();
    }

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
