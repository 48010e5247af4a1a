//! One PostgreSQL cluster directory (layout in the module docs): the server binaries, `initdb`,
//! the port and password files, the lock, starting, stopping and waiting for the server.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use sqlx::Connection;
use sqlx::postgres::PgConnection;

use super::child::ChildServer;
use super::system_user::ServerUser;
use super::url::{database_url, parse_port, pick_free_port};
use super::{Error, START_TIMEOUT, SUPERUSER, io_error};

/// Found in the server log when the chosen port was taken between choosing and binding it.
const PORT_IN_USE: &str = "Address already in use";

/// Polls until the server accepts a session at `url`. `exited` reports the server process's exit
/// status when it is our child, so a crash fails fast instead of waiting out the timeout.
pub(super) async fn wait_until_accepting(
    url: &str,
    cluster: &Cluster,
    port: u16,
    timeout: Duration,
    exited: impl Fn() -> Option<String>,
) -> Result<(), Error> {
    let started = Instant::now();
    loop {
        if let Ok(conn) = PgConnection::connect(url).await {
            let _ = conn.close().await;
            return Ok(());
        }
        if let Some(status) = exited() {
            let log_tail = log_tail(&cluster.log_file());
            if log_tail.contains(PORT_IN_USE) {
                return Err(Error::PortInUse { port, log: cluster.log_file(), log_tail });
            }
            return Err(Error::Exited {
                data_dir: cluster.data_dir(),
                status,
                log: cluster.log_file(),
                log_tail,
            });
        }
        if started.elapsed() > timeout {
            return Err(Error::StartTimeout {
                data_dir: cluster.data_dir(),
                port,
                waited: started.elapsed(),
                log: cluster.log_file(),
                log_tail: log_tail(&cluster.log_file()),
            });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The directory holding `initdb`, `pg_ctl` and `postgres` of one PostgreSQL version.
#[derive(Debug, Clone)]
pub struct Binaries {
    dir: PathBuf,
}

impl Binaries {
    /// Looks on PATH first (an administrator's choice wins), then in Debian's versioned
    /// directories, newest first. The three programs are taken from one directory so their
    /// versions match.
    pub fn find() -> Result<Self, Error> {
        let mut dirs: Vec<PathBuf> =
            std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect()).unwrap_or_default();
        let mut versioned: Vec<(u32, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path().join("bin"))))
            .collect();
        versioned.sort_by_key(|(version, _)| std::cmp::Reverse(*version));
        dirs.extend(versioned.into_iter().map(|(_, dir)| dir));
        let mut found_initdb = false;
        for dir in dirs {
            let Ok(initdb) = fs::canonicalize(dir.join("initdb")) else { continue };
            found_initdb = true;
            let Some(dir) = initdb.parent() else { continue };
            if dir.join("pg_ctl").is_file() && dir.join("postgres").is_file() {
                return Ok(Binaries { dir: dir.to_owned() });
            }
        }
        Err(Error::BinaryNotFound { binary: if found_initdb { "postgres" } else { "initdb" } })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// A PostgreSQL cluster in a directory of its own (see the module docs for the layout).
#[derive(Debug, Clone)]
pub struct Cluster {
    root: PathBuf,
    bins: Binaries,
    user: ServerUser,
}

impl Cluster {
    /// Finds the binaries and the server user (creating it when root, see
    /// [`ServerUser::resolve`]) and creates `root` if missing. Does not init or start anything.
    pub fn new(root: impl Into<PathBuf>) -> Result<Self, Error> {
        let root = root.into();
        let bins = Binaries::find()?;
        let user = ServerUser::resolve()?;
        fs::create_dir_all(&root).map_err(io_error("create", &root))?;
        let root = fs::canonicalize(&root).map_err(io_error("resolve", &root))?;
        Ok(Cluster { root, bins, user })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }
    pub fn data_dir(&self) -> PathBuf {
        self.root.join("data")
    }
    pub fn socket_dir(&self) -> PathBuf {
        self.root.join("run")
    }
    pub fn log_file(&self) -> PathBuf {
        self.root.join("server.log")
    }
    pub fn port_file(&self) -> PathBuf {
        self.root.join("port")
    }
    pub fn password_file(&self) -> PathBuf {
        self.root.join("password")
    }
    pub fn server_user(&self) -> &ServerUser {
        &self.user
    }

    /// Blocks until this process holds the cluster's lock; released when the file is dropped.
    pub fn lock(&self) -> Result<File, Error> {
        let path = self.root.join("lock");
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(io_error("open", &path))?;
        file.lock().map_err(io_error("lock", &path))?;
        Ok(file)
    }

    pub fn is_initialized(&self) -> bool {
        self.data_dir().join("PG_VERSION").is_file()
    }

    /// Whether this cluster was once initialized completely (`<root>/initialized`, written by
    /// the embedded default once it found the data directory complete): a data directory missing
    /// after that is damage, not a first start.
    pub fn was_initialized(&self) -> bool {
        self.root.join("initialized").exists()
    }

    /// Records that the cluster is initialized (idempotent; also for clusters made before the
    /// marker existed).
    pub fn mark_initialized(&self) -> Result<(), Error> {
        let path = self.root.join("initialized");
        if path.exists() {
            return Ok(());
        }
        fs::write(&path, "data/ was initialized; never initialize this cluster again\n")
            .map_err(io_error("write", &path))
    }

    /// Runs `initdb` as the server user. `durable: false` skips the fsyncs, for test clusters.
    /// Call with the lock held; a data directory left over by a failed init is replaced.
    pub fn init(&self, durable: bool) -> Result<(), Error> {
        self.check_reachable()?;
        fs::set_permissions(&self.root, fs::Permissions::from_mode(0o755))
            .map_err(io_error("set permissions of", &self.root))?;
        let data = self.data_dir();
        if data.exists() {
            fs::remove_dir_all(&data).map_err(io_error("remove the incomplete data directory", &data))?;
        }
        for (dir, mode) in [(data.clone(), 0o700), (self.socket_dir(), 0o700)] {
            fs::create_dir_all(&dir).map_err(io_error("create", &dir))?;
            fs::set_permissions(&dir, fs::Permissions::from_mode(mode))
                .map_err(io_error("set permissions of", &dir))?;
            self.chown(&dir)?;
        }

        let password = uuid::Uuid::new_v4().simple().to_string();
        write_private(&self.password_file(), &password)?;
        // initdb runs as the server user, so it reads the password from a file that user owns.
        let pwfile = self.root.join("initdb-password");
        write_private(&pwfile, &password)?;
        self.chown(&pwfile)?;
        let mut cmd = self.command(&self.bins.dir.join("initdb"));
        cmd.arg("-D")
            .arg(&data)
            .args(["-U", SUPERUSER, "--encoding=UTF8", "--locale=C", "--no-instructions"])
            // TCP needs the password. The socket directory is 0700, so only the server user and
            // root reach the socket, and there `trust` spares the harness a SCRAM exchange per
            // connection (tens of ms each in debug builds).
            .args(["--auth-host=scram-sha-256", "--auth-local=trust"])
            .arg(format!("--pwfile={}", pwfile.display()));
        if !durable {
            cmd.arg("--no-sync");
        }
        let result = run(cmd);
        let _ = fs::remove_file(&pwfile);
        result?;

        let conf = data.join("postgresql.conf");
        let mut file = OpenOptions::new().append(true).open(&conf).map_err(io_error("open", &conf))?;
        file.write_all(server_config(&self.socket_dir()).as_bytes()).map_err(io_error("write", &conf))?;
        Ok(())
    }

    /// The recorded port, or a newly chosen free one, recorded for later invocations.
    pub fn port(&self) -> Result<u16, Error> {
        let path = self.port_file();
        match fs::read_to_string(&path) {
            Ok(content) => parse_port(&content).ok_or(Error::PortFile { path, content }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let port = pick_free_port()?;
                self.write_port(port)?;
                Ok(port)
            }
            Err(e) => Err(io_error("read", path)(e)),
        }
    }

    pub(super) fn write_port(&self, port: u16) -> Result<(), Error> {
        let path = self.port_file();
        let tmp = self.root.join("port.tmp");
        fs::write(&tmp, format!("{port}\n")).map_err(io_error("write", &tmp))?;
        fs::rename(&tmp, &path).map_err(io_error("write", &path))
    }

    pub fn password(&self) -> Result<String, Error> {
        let path = self.password_file();
        let password = fs::read_to_string(&path).map_err(|e| Error::Damaged {
            path: self.root.clone(),
            what: format!("cannot read {}: {e}", path.display()),
        })?;
        Ok(password.trim().to_owned())
    }

    /// The superuser's URL for `database` on this cluster.
    pub fn url(&self, database: &str) -> Result<String, Error> {
        Ok(database_url(SUPERUSER, &self.password()?, self.port()?, database))
    }

    /// Whether a postmaster runs on this data directory, per `pg_ctl status`.
    pub fn is_running(&self) -> Result<bool, Error> {
        let mut cmd = self.command(&self.bins.dir.join("pg_ctl"));
        cmd.arg("status").arg("-D").arg(self.data_dir());
        let output = cmd.output().map_err(io_error("run", self.bins.dir.join("pg_ctl")))?;
        match output.status.code() {
            Some(0) => Ok(true),
            Some(3) => Ok(false),
            _ => Err(command_error(&cmd, &output)),
        }
    }

    /// The postmaster's pid from `postmaster.pid`, if the file exists.
    pub fn postmaster_pid(&self) -> Option<u32> {
        self.postmaster_line(0)?.parse().ok()
    }

    /// The pid of a live postmaster on this data directory: the one `postmaster.pid` names, if
    /// that process exists, is no zombie and is a `postgres` (a pid left by a crash and reused
    /// by another program does not count).
    pub fn postmaster_alive(&self) -> Option<u32> {
        let pid = self.postmaster_pid()?;
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let (comm, rest) = stat.split_once(" (")?.1.rsplit_once(") ")?;
        (comm == "postgres" && !rest.starts_with('Z')).then_some(pid)
    }

    /// Waits until the process `postmaster.pid` names is gone, or `timeout` passed: a postmaster
    /// that died stays a zombie until init reaps it, and until then `pg_ctl` and a new
    /// postmaster both take it for a live server.
    pub fn wait_until_reaped(&self, timeout: Duration) -> Result<(), Error> {
        let Some(pid) = self.postmaster_pid() else { return Ok(()) };
        let started = Instant::now();
        while Path::new(&format!("/proc/{pid}")).exists() {
            if started.elapsed() > timeout {
                return Err(Error::NotRunning {
                    path: self.root.clone(),
                    detail: format!(
                        "its postmaster (pid {pid}) died and was not reaped within {timeout:?}; retry"
                    ),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// The port the running postmaster listens on, from `postmaster.pid` (its fourth line): the
    /// server's own word, where the `port` file may be stale or lost.
    pub fn postmaster_port(&self) -> Option<u16> {
        self.postmaster_line(3)?.parse().ok()
    }

    fn postmaster_line(&self, index: usize) -> Option<String> {
        let text = fs::read_to_string(self.data_dir().join("postmaster.pid")).ok()?;
        Some(text.lines().nth(index)?.trim().to_owned())
    }

    /// Starts the server as a daemon (`pg_ctl start`, which puts it in a session of its own) that
    /// outlives this process, and waits until it is ready.
    pub fn start_daemon(&self, port: u16) -> Result<(), Error> {
        let log = self.prepare_log(false)?;
        let mut cmd = self.command(&self.bins.dir.join("pg_ctl"));
        cmd.arg("start").arg("-D").arg(self.data_dir()).arg("-l").arg(&log).args([
            "-w",
            "-s",
            "-t",
            &START_TIMEOUT.as_secs().to_string(),
            "-o",
            &format!("-p {port}"),
        ]);
        // pg_ctl sends the server's output to the log, so capturing pg_ctl's output cannot hang.
        let output = cmd.output().map_err(io_error("run", self.bins.dir.join("pg_ctl")))?;
        if output.status.success() {
            return Ok(());
        }
        let log_tail = log_tail(&log);
        if log_tail.contains(PORT_IN_USE) {
            return Err(Error::PortInUse { port, log, log_tail });
        }
        Err(command_error(&cmd, &output))
    }

    /// Stops a running server (`pg_ctl stop -m fast`) and waits until it has exited.
    pub fn stop(&self) -> Result<(), Error> {
        if !self.is_running()? {
            return Ok(());
        }
        let mut cmd = self.command(&self.bins.dir.join("pg_ctl"));
        cmd.arg("stop").arg("-D").arg(self.data_dir()).args(["-m", "fast", "-w", "-s", "-t", "60"]);
        run(cmd).map(drop)
    }

    /// Starts `postgres` as a child of this process that dies with it (see [`ChildServer`]).
    pub fn spawn_child(&self, port: u16, settings: &[(&str, &str)]) -> Result<ChildServer, Error> {
        let log_path = self.prepare_log(true)?;
        let log = OpenOptions::new().append(true).open(&log_path).map_err(io_error("open", &log_path))?;
        let log2 = log.try_clone().map_err(io_error("open", &log_path))?;
        let postgres = self.bins.dir.join("postgres");
        let mut cmd = self.command(&postgres);
        cmd.arg("-D").arg(self.data_dir()).arg("-p").arg(port.to_string());
        for (name, value) in settings {
            cmd.arg("-c").arg(format!("{name}={value}"));
        }
        cmd.stdin(Stdio::null()).stdout(log).stderr(log2);
        ChildServer::spawn(cmd, port)
    }

    /// Creates the log file as the server user's, so `pg_ctl -l` can append to it.
    fn prepare_log(&self, truncate: bool) -> Result<PathBuf, Error> {
        let log = self.log_file();
        OpenOptions::new()
            .create(true)
            .append(!truncate)
            .write(true)
            .truncate(truncate)
            .mode(0o640)
            .open(&log)
            .map_err(io_error("create", &log))?;
        self.chown(&log)?;
        Ok(log)
    }

    fn command(&self, program: &Path) -> Command {
        let mut cmd = Command::new(program);
        // A clean environment: PGDATA, PGPORT or a locale in the caller's shell must not leak in.
        cmd.env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .env("LC_ALL", "C")
            .current_dir(&self.root);
        if let ServerUser::Switch { uid, gid, .. } = &self.user {
            cmd.uid(*uid).gid(*gid);
        }
        cmd
    }

    fn chown(&self, path: &Path) -> Result<(), Error> {
        if let ServerUser::Switch { uid, gid, .. } = &self.user {
            std::os::unix::fs::chown(path, Some(*uid), Some(*gid)).map_err(io_error("chown", path))?;
        }
        Ok(())
    }

    /// The server user must be able to walk to the cluster root; a state directory under a 0700
    /// home directory of root's is the usual way to fail this.
    fn check_reachable(&self) -> Result<(), Error> {
        let ServerUser::Switch { name, uid, gid } = &self.user else { return Ok(()) };
        for dir in self.root.ancestors() {
            let meta = fs::metadata(dir).map_err(io_error("inspect", dir))?;
            let mode = meta.mode();
            let searchable = if meta.uid() == *uid {
                mode & 0o100 != 0
            } else if meta.gid() == *gid {
                mode & 0o010 != 0
            } else {
                mode & 0o001 != 0
            };
            if !searchable {
                return Err(Error::NotReachable { path: dir.to_owned(), user: name.clone() });
            }
        }
        Ok(())
    }
}

/// Settings appended to `postgresql.conf` at init; the port is passed at each start.
fn server_config(socket_dir: &Path) -> String {
    format!(
        "\n# innerwall: a private cluster, reachable on 127.0.0.1 only.\n\
         listen_addresses = '127.0.0.1'\n\
         unix_socket_directories = '{}'\n",
        socket_dir.display().to_string().replace('\'', "''")
    )
}

fn write_private(path: &Path, content: &str) -> Result<(), Error> {
    let _ = fs::remove_file(path);
    let mut file = OpenOptions::new()
        .create_new(true)
        .write(true)
        .mode(0o600)
        .open(path)
        .map_err(io_error("create", path))?;
    file.write_all(content.as_bytes()).map_err(io_error("write", path))
}

fn run(mut cmd: Command) -> Result<Output, Error> {
    let output = cmd.output().map_err(io_error("run", cmd.get_program()))?;
    if output.status.success() { Ok(output) } else { Err(command_error(&cmd, &output)) }
}

fn command_error(cmd: &Command, output: &Output) -> Error {
    let command = std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|s| s.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ");
    let text =
        format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    Error::Command { command, status: output.status.to_string(), output: tail_lines(&text, 20) }
}

/// The last lines of the server log, for start-up errors.
fn log_tail(path: &Path) -> String {
    let mut buf = Vec::new();
    if let Ok(mut file) = File::open(path) {
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        let _ = file.seek(SeekFrom::Start(len.saturating_sub(8192)));
        let _ = file.read_to_end(&mut buf);
    }
    tail_lines(&String::from_utf8_lossy(&buf), 20)
}

fn tail_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.trim_end().lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_quotes_the_socket_dir() {
        assert!(server_config(Path::new("/tmp/it's")).contains("unix_socket_directories = '/tmp/it''s'"));
    }
}
