//! How `innerwall` logs (`--log-format`): `text` for people, `json` (one JSON object per line,
//! tracing-subscriber's format) for log pipelines; on stderr, filtered by `INNERWALL_LOG`
//! (default `warn`). Notices — the lines an operator always sees: where `serve` listens, a
//! fatal error — are events of the target [`NOTICE`], whatever the filter: their bare message
//! in text mode (as they always read), JSON events in JSON mode, so that with `--log-format
//! json` every line on stderr is JSON.

use tracing::Subscriber;
use tracing_subscriber::filter::{EnvFilter, LevelFilter, Targets};
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::{Layer as _, Registry, fmt};

/// The target of notices: `tracing::info!(target: NOTICE, "innerwall: …")`.
pub const NOTICE: &str = "innerwall::notice";

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// Installs the process's subscriber, on stderr.
pub fn init(format: LogFormat) {
    let filter = std::env::var("INNERWALL_LOG").unwrap_or_default();
    let _ = tracing::subscriber::set_global_default(subscriber(format, &filter, std::io::stderr));
}

/// `filter` is an `EnvFilter` spelling; empty or malformed means `warn`.
fn subscriber<W>(format: LogFormat, filter: &str, writer: W) -> Box<dyn Subscriber + Send + Sync>
where
    W: for<'w> MakeWriter<'w> + Clone + Send + Sync + 'static,
{
    let spec = if filter.trim().is_empty() { "warn" } else { filter };
    let filter = || EnvFilter::try_new(spec).unwrap_or_else(|_| EnvFilter::new("warn"));
    let notices = |level: &str| format!("{NOTICE}={level}").parse().expect("a valid directive");
    match format {
        LogFormat::Text => {
            let logs =
                fmt::layer().with_writer(writer.clone()).with_filter(filter().add_directive(notices("off")));
            let notices = fmt::layer()
                .with_writer(writer)
                .without_time()
                .with_level(false)
                .with_target(false)
                .with_ansi(false)
                .with_filter(Targets::new().with_target(NOTICE, LevelFilter::TRACE));
            Box::new(Registry::default().with(logs).with(notices))
        }
        LogFormat::Json => {
            let logs =
                fmt::layer().json().with_writer(writer).with_filter(filter().add_directive(notices("trace")));
            Box::new(Registry::default().with(logs))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// A writer into a shared buffer.
    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buffer {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'w> MakeWriter<'w> for Buffer {
        type Writer = Buffer;
        fn make_writer(&'w self) -> Buffer {
            self.clone()
        }
    }

    /// What a subscriber of `format` with `filter` writes for a notice, a warning and an info.
    fn logged(format: LogFormat, filter: &str) -> String {
        let buffer = Buffer::default();
        tracing::subscriber::with_default(subscriber(format, filter, buffer.clone()), || {
            tracing::info!(target: NOTICE, "innerwall: listening on 127.0.0.1:7443 as localhost");
            tracing::warn!(workload = "w-1", "a warning");
            tracing::info!("an info");
        });
        String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap()
    }

    #[test]
    fn text_notices_read_as_they_always_did() {
        let text = logged(LogFormat::Text, "");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "the info is filtered out: {text}");
        assert_eq!(lines[0], "innerwall: listening on 127.0.0.1:7443 as localhost");
        assert!(lines[1].contains("a warning") && lines[1].contains("workload"), "{text}");
        let quiet = logged(LogFormat::Text, "error");
        assert_eq!(quiet, "innerwall: listening on 127.0.0.1:7443 as localhost\n", "notices pass any filter");
    }

    #[test]
    fn json_lines_are_json_objects_notices_included() {
        let text = logged(LogFormat::Json, "info");
        let events: Vec<serde_json::Value> =
            text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"))).collect();
        let summary: Vec<(&str, &str, &str)> = events
            .iter()
            .map(|e| {
                (
                    e["level"].as_str().unwrap(),
                    e["target"].as_str().unwrap(),
                    e["fields"]["message"].as_str().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            summary,
            [
                ("INFO", NOTICE, "innerwall: listening on 127.0.0.1:7443 as localhost"),
                ("WARN", module_path!(), "a warning"),
                ("INFO", module_path!(), "an info"),
            ]
        );
        assert_eq!(events[1]["fields"]["workload"], "w-1");
        assert!(events.iter().all(|e| e["timestamp"].is_string()));
        assert_eq!(
            logged(LogFormat::Json, "not a [filter").lines().count(),
            2,
            "malformed: warn, and notices"
        );
    }
}
