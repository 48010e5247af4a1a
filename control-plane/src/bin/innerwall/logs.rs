//! How `innerwall` logs (`--log-format`): `text` for people, `json` (one JSON object per line,
//! tracing-subscriber's format) for log pipelines; on stderr, filtered by `--log-level`
//! (`INNERWALL_LOG`, default `warn`; a configuration reload changes it while `serve` runs). Notices — the lines an operator always sees: where `serve` listens, a
//! fatal error — are events of the target [`NOTICE`], whatever the filter: their bare message
//! in text mode (as they always read), JSON events in JSON mode, so that with `--log-format
//! json` every line on stderr is JSON.

use tracing::Subscriber;
use tracing_subscriber::filter::{EnvFilter, LevelFilter, Targets};
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::{Layer as _, Registry, fmt, reload};

/// The target of notices: `tracing::info!(target: NOTICE, "innerwall: …")`.
pub const NOTICE: &str = "innerwall::notice";

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// Changes the filter of the subscriber it came with.
type Reload = Box<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

static RELOAD: std::sync::OnceLock<Reload> = std::sync::OnceLock::new();

/// Installs the process's subscriber, on stderr, with `filter` (`--log-level`, an `EnvFilter`
/// spelling; empty or malformed means `warn`).
pub fn init(format: LogFormat, filter: &str) {
    let (subscriber, reload) = subscriber(format, filter, std::io::stderr);
    if tracing::subscriber::set_global_default(subscriber).is_ok() {
        let _ = RELOAD.set(reload);
    }
}

/// Puts a new filter in force (a configuration reload); a malformed one changes nothing.
pub fn set_filter(filter: &str) -> Result<(), String> {
    RELOAD.get().ok_or("no subscriber is installed")?(filter)
}

/// `filter` is an `EnvFilter` spelling; empty or malformed means `warn`.
fn subscriber<W>(format: LogFormat, filter: &str, writer: W) -> (Box<dyn Subscriber + Send + Sync>, Reload)
where
    W: for<'w> MakeWriter<'w> + Clone + Send + Sync + 'static,
{
    let notices = |level: &str| format!("{NOTICE}={level}").parse().expect("a valid directive");
    // Notices pass any filter: off in the text logs (they have a layer of their own), on in JSON.
    let notices_level = match format {
        LogFormat::Text => "off",
        LogFormat::Json => "trace",
    };
    let parse = move |spec: &str| {
        let spec = if spec.trim().is_empty() { "warn" } else { spec };
        EnvFilter::try_new(spec)
            .map(|f| f.add_directive(notices(notices_level)))
            .map_err(|e| format!("{spec:?}: {e}"))
    };
    let initial = parse(filter).unwrap_or_else(|_| parse("warn").expect("a valid filter"));
    let (filter, handle) = reload::Layer::new(initial);
    let reload: Reload = Box::new(move |spec| handle.reload(parse(spec)?).map_err(|e| e.to_string()));
    let subscriber: Box<dyn Subscriber + Send + Sync> = match format {
        LogFormat::Text => {
            let logs = fmt::layer().with_writer(writer.clone()).with_filter(filter);
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
            Box::new(Registry::default().with(fmt::layer().json().with_writer(writer).with_filter(filter)))
        }
    };
    (subscriber, reload)
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
        tracing::subscriber::with_default(subscriber(format, filter, buffer.clone()).0, || {
            tracing::info!(target: NOTICE, "innerwall: listening on 127.0.0.1:7443 as localhost");
            tracing::warn!(workload = "w-1", "a warning");
            tracing::info!("an info");
        });
        String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap()
    }

    #[test]
    fn a_reloaded_filter_applies_to_what_comes_after_and_a_bad_one_changes_nothing() {
        let buffer = Buffer::default();
        let (subscriber, reload) = subscriber(LogFormat::Text, "warn", buffer.clone());
        tracing::subscriber::with_default(subscriber, || {
            tracing::info!("before the reload");
            reload("info").unwrap();
            tracing::info!("after the reload");
            assert!(reload("not a [filter").is_err());
            tracing::info!("after the refused reload");
        });
        let text = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
        assert!(!text.contains("before the reload"), "{text}");
        assert!(text.contains("after the reload") && text.contains("after the refused reload"), "{text}");
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
