//! The account the server runs as: the caller, or for a root caller the unprivileged system user
//! [`SERVER_USER`], created on first use.

use std::fs::File;
use std::path::Path;
use std::process::Command;

use super::{Error, SERVER_USER, io_error};

/// The account the server processes run as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerUser {
    /// The caller is not root: the server runs as the caller.
    Current,
    /// The caller is root: the server runs as this unprivileged account.
    Switch { name: String, uid: u32, gid: u32 },
}

impl ServerUser {
    /// [`ServerUser::Current`] unless running as root; then [`SERVER_USER`], created as a system
    /// account if missing. A dedicated account rather than a distribution's `postgres` user: it
    /// exists on every machine after first use, and our cluster's files stay apart from any
    /// system cluster's.
    pub fn resolve() -> Result<Self, Error> {
        if !running_as_root() {
            return Ok(ServerUser::Current);
        }
        ensure_system_user(SERVER_USER)
    }
}

fn running_as_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// `(uid, gid)` of the account `name`, or `None` if there is none or the lookup fails.
fn lookup_user(name: &str) -> Option<(u32, u32)> {
    // getpwnam_r goes through NSS, so accounts from LDAP or systemd-userdbd count too.
    let user = nix::unistd::User::from_name(name).ok()??;
    Some((user.uid.as_raw(), user.gid.as_raw()))
}

fn ensure_system_user(name: &str) -> Result<ServerUser, Error> {
    let found = |uid, gid| {
        if uid == 0 {
            return Err(Error::ServerUser { user: name.to_owned(), detail: "it has uid 0".to_owned() });
        }
        Ok(ServerUser::Switch { name: name.to_owned(), uid, gid })
    };
    if let Some((uid, gid)) = lookup_user(name) {
        return found(uid, gid);
    }
    // Concurrent useradds (parallel tests on a fresh machine) were seen to create the account
    // several times over, so creators take turns: flock on /etc/passwd, which useradd's own
    // locking (lckpwdf) ignores. Only root gets here, and root can open it.
    let passwd = File::open("/etc/passwd").map_err(io_error("open", "/etc/passwd"))?;
    passwd.lock().map_err(io_error("lock", "/etc/passwd"))?;
    if let Some((uid, gid)) = lookup_user(name) {
        return found(uid, gid);
    }
    let useradd = if Path::new("/usr/sbin/useradd").is_file() { "/usr/sbin/useradd" } else { "useradd" };
    let output = Command::new(useradd)
        .args(["--system", "--user-group", "--no-create-home", "--shell", "/usr/sbin/nologin", name])
        .output()
        .map_err(|e| Error::ServerUser {
            user: name.to_owned(),
            detail: format!("running {useradd}: {e}"),
        })?;
    match lookup_user(name) {
        Some((uid, gid)) => found(uid, gid),
        None => Err(Error::ServerUser {
            user: name.to_owned(),
            detail: format!("useradd {}: {}", output.status, String::from_utf8_lossy(&output.stderr).trim()),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accounts_are_looked_up() {
        assert_eq!(lookup_user("root"), Some((0, 0)));
        assert_eq!(lookup_user("innerwall-no-such-account"), None);
        assert_eq!(lookup_user("nul\0byte"), None);
    }
}
