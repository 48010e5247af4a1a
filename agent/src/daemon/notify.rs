//! systemd's service notifications (`sd_notify`), without libsystemd: under `Type=notify` the
//! service manager hands `NOTIFY_SOCKET` (a path, or `@name` in the abstract namespace) and, with
//! `WatchdogSec=`, `WATCHDOG_USEC` (and `WATCHDOG_PID`). The agent says `READY=1` only once the
//! persisted policy is back in the kernel (ENF-5), so "started" means "enforcing what it last
//! enforced"; `WATCHDOG=1` at half the watchdog interval from a task on the runtime, so a wedged
//! runtime is restarted; `STOPPING=1` when it stops. Outside systemd nothing is sent.

use std::os::linux::net::SocketAddrExt as _;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::Duration;

/// Where notifications go, when a service manager asked for them.
#[derive(Debug)]
pub struct Notifier {
    socket: UnixDatagram,
    to: SocketAddr,
}

impl Notifier {
    /// From `NOTIFY_SOCKET`; `None` when it is unset or unusable (logged).
    pub fn from_env() -> Option<Notifier> {
        let path = std::env::var_os("NOTIFY_SOCKET")?;
        let path = path.to_string_lossy();
        let to = match path.strip_prefix('@') {
            Some(name) => SocketAddr::from_abstract_name(name.as_bytes()),
            None => SocketAddr::from_pathname(path.as_ref()),
        };
        match (UnixDatagram::unbound(), to) {
            (Ok(socket), Ok(to)) => Some(Notifier { socket, to }),
            (Err(e), _) | (_, Err(e)) => {
                tracing::warn!("NOTIFY_SOCKET={path} cannot be used: {e}");
                None
            }
        }
    }

    /// Sends one notification (`KEY=VALUE` lines); a failure is logged, never fatal.
    pub fn send(&self, state: &str) {
        if let Err(e) = self.socket.send_to_addr(state.as_bytes(), &self.to) {
            tracing::warn!("could not notify the service manager ({state:?}): {e}");
        }
    }
}

/// How often to say `WATCHDOG=1`: half of `WATCHDOG_USEC`, when the watchdog is on and meant for
/// this process (`WATCHDOG_PID` unset or ours).
pub fn watchdog_interval() -> Option<Duration> {
    if let Some(pid) = std::env::var_os("WATCHDOG_PID")
        && pid.to_string_lossy().parse::<u32>().ok() != Some(std::process::id())
    {
        return None;
    }
    let usec = std::env::var("WATCHDOG_USEC").ok()?.parse::<u64>().ok().filter(|u| *u > 0)?;
    Some(Duration::from_micros(usec / 2))
}

/// Says `WATCHDOG=1` every `every` until stopped.
pub async fn watchdog_forever(notifier: std::sync::Arc<Notifier>, every: Duration) {
    let mut ticker = tokio::time::interval(every);
    loop {
        ticker.tick().await;
        notifier.send("WATCHDOG=1");
    }
}
