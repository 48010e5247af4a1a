//! A `postgres` server run as a child of this process that dies with it: the parent-death
//! signal, the keeper thread that owns the child, and stopping it.

use std::io;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex, PoisonError, mpsc};

use nix::errno::Errno;
use nix::sys::prctl;
use nix::sys::signal::{self, Signal};
use nix::unistd::{self, Pid};

use super::{Error, io_error};

/// A `postgres` started by [`Cluster::spawn_child`](super::Cluster::spawn_child): a direct child
/// that receives SIGQUIT (immediate shutdown) when this process ends, however it ends.
#[derive(Debug)]
pub struct ChildServer {
    pid: u32,
    port: u16,
    exit: Arc<Mutex<Option<String>>>,
}

impl ChildServer {
    /// Spawns `cmd` (the `postgres` command line, with its output redirected) on a keeper thread
    /// and returns once it has started.
    pub(super) fn spawn(mut cmd: Command, port: u16) -> Result<Self, Error> {
        let program = PathBuf::from(cmd.get_program());
        let parent = unistd::getpid();
        #[allow(unsafe_code)]
        // SAFETY: the closure runs in the forked child before exec. It makes only
        // async-signal-safe calls (prctl, getppid; nix's wrappers add only an errno read) and
        // does not allocate (an `Errno` becomes an `io::Error` without allocating). std runs it
        // after setgid/setuid, which matters: a credential change clears the parent-death signal.
        unsafe {
            cmd.pre_exec(move || {
                // SIGQUIT is postgres's immediate shutdown: it stops its backends and frees its
                // shared memory, which SIGKILL would leave behind.
                prctl::set_pdeathsig(Signal::SIGQUIT)?;
                // The parent may have died before prctl took effect; the signal would never come.
                if unistd::getppid() != parent {
                    return Err(Errno::ESRCH.into());
                }
                Ok(())
            });
        }

        let exit = Arc::new(Mutex::new(None));
        let (started_tx, started_rx) = mpsc::channel();
        let thread_exit = Arc::clone(&exit);
        // PR_SET_PDEATHSIG fires when the *thread* that forked the child ends, so a thread of our
        // own forks the server and then lives exactly as long as it; a tokio blocking-pool thread
        // would be retired after an idle period and take the server with it.
        std::thread::Builder::new()
            .name("postgres-keeper".to_owned())
            .spawn(move || {
                let mut child = match cmd.spawn() {
                    Ok(child) => child,
                    Err(e) => {
                        let _ = started_tx.send(Err(e));
                        return;
                    }
                };
                let _ = started_tx.send(Ok(child.id()));
                let status = match child.wait() {
                    Ok(status) => status.to_string(),
                    Err(e) => format!("wait failed: {e}"),
                };
                *thread_exit.lock().unwrap_or_else(PoisonError::into_inner) = Some(status);
            })
            .map_err(io_error("spawn a keeper thread for", &program))?;
        let pid = started_rx
            .recv()
            .map_err(|_| io_error("start", &program)(io::Error::other("keeper thread ended")))?
            .map_err(io_error("start", &program))?;
        Ok(ChildServer { pid, port, exit })
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }
    pub fn port(&self) -> u16 {
        self.port
    }
    /// The exit status once the server has exited.
    pub fn exit_status(&self) -> Option<String> {
        self.exit.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
    /// Sends SIGQUIT (immediate shutdown) unless it has exited already.
    pub fn kill(&self) {
        // Not yet reaped by the keeper thread, so the pid still names our child, not a reuse.
        if self.exit_status().is_none()
            && let Ok(pid) = i32::try_from(self.pid)
        {
            let _ = signal::kill(Pid::from_raw(pid), Signal::SIGQUIT);
        }
    }
}
