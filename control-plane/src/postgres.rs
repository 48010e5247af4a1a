//! PostgreSQL for the control plane: a private cluster run from the system's server binaries
//! (the `innerwall` CLI's embedded default and the test harness's server) and the migrated pool.
//!
//! A cluster directory holds:
//!
//! ```text
//! <root>/lock        flock'ed while a process inits, starts or stops the cluster
//! <root>/port        the TCP port on 127.0.0.1, chosen once and reused by later invocations
//! <root>/password    the superuser's password (0600, owned by the invoking user)
//! <root>/server.log  the server's log
//! <root>/data/       PGDATA, owned by the server user
//! <root>/run/        the server's unix socket directory
//! ```
//!
//! The server never runs as root (`initdb` and `postgres` refuse to): a root caller runs it as the
//! dedicated system user [`SERVER_USER`], created on first use.
//!
//! Authentication: TCP on 127.0.0.1 takes the superuser's SCRAM password, because any local
//! account can open a TCP connection there and `trust` would make it superuser. The unix socket
//! uses `trust`: its directory is 0700, so only the server user and root reach it. The CLI hands
//! out the TCP URL (with password); the test harness uses the socket, which spares every test
//! connection a SCRAM exchange (tens of milliseconds in debug builds).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex, PoisonError, mpsc};
use std::time::{Duration, Instant};

use sqlx::migrate::{MigrateError, Migrator};
use sqlx::postgres::{PgConnection, PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection};

/// The control plane's schema, embedded at compile time.
pub static MIGRATOR: Migrator = sqlx::migrate!("../migrations");

/// The unprivileged system account a root caller runs the server as.
pub const SERVER_USER: &str = "innerwall";
/// The cluster's superuser role.
pub const SUPERUSER: &str = "innerwall";
/// The database the embedded cluster serves to the control plane.
pub const DATABASE: &str = "innerwall";

const START_TIMEOUT: Duration = Duration::from_secs(60);
/// Found in the server log when the chosen port was taken between choosing and binding it.
const PORT_IN_USE: &str = "Address already in use";
const TEST_DIR_PREFIX: &str = "innerwall-pgtest-";

/// Settings for a throw-away test server: durability off, room for many parallel tests.
const TEST_SETTINGS: &[(&str, &str)] = &[
    ("fsync", "off"),
    ("synchronous_commit", "off"),
    ("full_page_writes", "off"),
    ("max_connections", "200"),
];

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "`{binary}` not found on PATH or in /usr/lib/postgresql/*/bin: install the PostgreSQL server \
         (apt install postgresql-15) or pass --database-url"
    )]
    BinaryNotFound { binary: &'static str },
    #[error(
        "postgres cannot run as root and the system user {user:?} is missing and could not be created \
         ({detail}): create it with `useradd --system --no-create-home --shell /usr/sbin/nologin {user}` \
         or run as an unprivileged user"
    )]
    ServerUser { user: String, detail: String },
    #[error(
        "{path} is not reachable by the server user {user:?} (a directory on the way lacks search \
         permission): put the state directory under /var/lib or /tmp, or `chmod o+x` its parents"
    )]
    NotReachable { path: PathBuf, user: String },
    #[error("cannot {action} {path}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("`{command}` failed ({status}):\n{output}")]
    Command { command: String, status: String, output: String },
    #[error("invalid port file {path}: {content:?}; delete it to pick a new port")]
    PortFile { path: PathBuf, content: String },
    #[error(
        "cluster directory {path} is damaged ({what}): stop any server using it and delete the \
         directory to start over"
    )]
    Damaged { path: PathBuf, what: String },
    #[error("port {port} on 127.0.0.1 is in use; server log {log} ends with:\n{log_tail}")]
    PortInUse { port: u16, log: PathBuf, log_tail: String },
    #[error(
        "postgres in {data_dir} did not accept connections on 127.0.0.1:{port} within {waited:?}; \
         server log {log} ends with:\n{log_tail}"
    )]
    StartTimeout { data_dir: PathBuf, port: u16, waited: Duration, log: PathBuf, log_tail: String },
    #[error(
        "postgres in {data_dir} exited while starting ({status}); server log {log} ends with:\n{log_tail}"
    )]
    Exited { data_dir: PathBuf, status: String, log: PathBuf, log_tail: String },
    #[error(
        "cannot connect to {url}: check that the server runs and that the URL's host, port, user, \
         password and database are right"
    )]
    Connect {
        url: String,
        #[source]
        source: sqlx::Error,
    },
    #[error("migrating the database at {url} failed: fix the migration or the database, then retry")]
    Migrate {
        url: String,
        #[source]
        source: MigrateError,
    },
    #[error("{action} failed")]
    Sql {
        action: String,
        #[source]
        source: sqlx::Error,
    },
}

fn io_error(action: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(io::Error) -> Error {
    move |source| Error::Io { action, path: path.into(), source }
}

/// Connects to `url` and brings its schema up to date with [`MIGRATOR`].
pub async fn connect(url: &str) -> Result<PgPool, Error> {
    let pool = pool_options()
        .connect(url)
        .await
        .map_err(|source| Error::Connect { url: redact_url(url), source })?;
    MIGRATOR.run(&pool).await.map_err(|source| Error::Migrate { url: redact_url(url), source })?;
    Ok(pool)
}

/// The pool settings [`connect`] uses; callers that manage migrations themselves start from here.
pub fn pool_options() -> PgPoolOptions {
    PgPoolOptions::new().max_connections(10).min_connections(0).acquire_timeout(Duration::from_secs(10))
}

/// The embedded default of the `innerwall` CLI: initializes the cluster under
/// `<state_dir>/postgres` if missing, starts it as a daemon that outlives this process if it is not
/// running, creates the `innerwall` database if missing and returns its URL.
///
/// Concurrent callers serialize on the cluster's lock file; the second finds the server running.
pub async fn embedded(state_dir: &Path) -> Result<String, Error> {
    let root = state_dir.join("postgres");
    let (cluster, port, password, lock) = blocking(move || {
        let cluster = Cluster::new(root)?;
        let lock = cluster.lock()?;
        if !cluster.is_initialized() {
            cluster.init(true)?;
        }
        let password = cluster.password()?;
        let mut port = cluster.port()?;
        if !cluster.is_running()? {
            let mut attempts = 0;
            loop {
                match cluster.start_daemon(port) {
                    Ok(()) => break,
                    // After a reboot another program may hold the recorded port: move once.
                    Err(Error::PortInUse { .. }) if attempts < 3 => {
                        attempts += 1;
                        port = pick_free_port()?;
                        cluster.write_port(port)?;
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        Ok((cluster, port, password, lock))
    })
    .await?;
    let admin_url = database_url(SUPERUSER, &password, port, "postgres");
    wait_until_accepting(&admin_url, &cluster, port, START_TIMEOUT, || None).await?;
    ensure_database(&admin_url, DATABASE).await?;
    drop(lock);
    Ok(database_url(SUPERUSER, &password, port, DATABASE))
}

/// The cluster [`embedded`] manages for `state_dir`, e.g. to stop it.
pub fn embedded_cluster(state_dir: &Path) -> Result<Cluster, Error> {
    Cluster::new(state_dir.join("postgres"))
}

async fn ensure_database(admin_url: &str, database: &str) -> Result<(), Error> {
    let mut conn = PgConnection::connect(admin_url)
        .await
        .map_err(|source| Error::Connect { url: redact_url(admin_url), source })?;
    let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
        .bind(database)
        .fetch_one(&mut conn)
        .await
        .map_err(|source| Error::Sql { action: format!("looking up database {database:?}"), source })?;
    if !exists {
        sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {}", quote_ident(database))))
            .execute(&mut conn)
            .await
            .map_err(|source| Error::Sql { action: format!("creating database {database:?}"), source })?;
    }
    let _ = conn.close().await;
    Ok(())
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Error> + Send + 'static,
) -> Result<T, Error> {
    match tokio::task::spawn_blocking(f).await {
        Ok(result) => result,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

/// Polls until the server accepts a session at `url`. `exited` reports the server process's exit
/// status when it is our child, so a crash fails fast instead of waiting out the timeout.
async fn wait_until_accepting(
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
    #[allow(unsafe_code)]
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    euid == 0
}

fn lookup_user(name: &str) -> Option<(u32, u32)> {
    // getent goes through NSS, so accounts from LDAP or systemd-userdbd count too.
    let output = Command::new("getent").args(["passwd", name]).output().ok()?;
    if !output.status.success() {
        return None;
    }
    parse_passwd_line(String::from_utf8_lossy(&output.stdout).lines().next()?)
}

/// `(uid, gid)` of a passwd(5) line.
fn parse_passwd_line(line: &str) -> Option<(u32, u32)> {
    let mut fields = line.split(':');
    let (_name, _password) = (fields.next()?, fields.next()?);
    Some((fields.next()?.parse().ok()?, fields.next()?.parse().ok()?))
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

    fn write_port(&self, port: u16) -> Result<(), Error> {
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
        fs::read_to_string(self.data_dir().join("postmaster.pid")).ok()?.lines().next()?.trim().parse().ok()
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
        let parent = std::process::id();
        #[allow(unsafe_code)]
        // SAFETY: the closure runs in the forked child before exec. It makes only
        // async-signal-safe calls (prctl, getppid) and does not allocate. std runs it after
        // setgid/setuid, which matters: a credential change clears the parent-death signal.
        unsafe {
            cmd.pre_exec(move || {
                // SIGQUIT is postgres's immediate shutdown: it stops its backends and frees its
                // shared memory, which SIGKILL would leave behind.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGQUIT as libc::c_ulong) != 0 {
                    return Err(io::Error::last_os_error());
                }
                // The parent may have died before prctl took effect; the signal would never come.
                if libc::getppid() as u32 != parent {
                    return Err(io::Error::from_raw_os_error(libc::ESRCH));
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
            .map_err(io_error("spawn a keeper thread for", &postgres))?;
        let pid = started_rx
            .recv()
            .map_err(|_| io_error("start", &postgres)(io::Error::other("keeper thread ended")))?
            .map_err(io_error("start", &postgres))?;
        Ok(ChildServer { pid, port, exit })
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

/// A `postgres` started by [`Cluster::spawn_child`]: a direct child that receives SIGQUIT
/// (immediate shutdown) when this process ends, however it ends.
#[derive(Debug)]
pub struct ChildServer {
    pid: u32,
    port: u16,
    exit: Arc<Mutex<Option<String>>>,
}

impl ChildServer {
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
        if self.exit_status().is_none() {
            send_signal(self.pid, libc::SIGQUIT);
        }
    }
}

fn send_signal(pid: u32, signal: libc::c_int) {
    let Ok(pid) = libc::pid_t::try_from(pid) else { return };
    #[allow(unsafe_code)]
    // SAFETY: kill has no memory-safety preconditions; `pid` is a child we have not yet reaped.
    unsafe {
        libc::kill(pid, signal);
    }
}

/// The private server of one test process: a cluster under the temp directory whose server
/// dies with the process. The directory stays behind when the process ends; the next
/// [`TestCluster::start`] removes directories of processes that are gone.
#[derive(Debug)]
pub struct TestCluster {
    cluster: Cluster,
    server: ChildServer,
    admin_url: String,
}

impl TestCluster {
    pub async fn start() -> Result<Self, Error> {
        let cluster = blocking(|| {
            let parent = std::env::temp_dir();
            remove_stale_test_clusters(&parent);
            let short = &uuid::Uuid::new_v4().simple().to_string()[..8];
            let cluster =
                Cluster::new(parent.join(format!("{TEST_DIR_PREFIX}{}-{short}", std::process::id())))?;
            cluster.init(false)?;
            Ok(cluster)
        })
        .await?;
        let mut attempt = 0;
        loop {
            let port = pick_free_port()?;
            cluster.write_port(port)?;
            let server = cluster.spawn_child(port, TEST_SETTINGS)?;
            let admin_url = socket_url(SUPERUSER, &cluster.socket_dir(), port, "postgres");
            match wait_until_accepting(&admin_url, &cluster, port, START_TIMEOUT, || server.exit_status())
                .await
            {
                Ok(()) => return Ok(TestCluster { cluster, server, admin_url }),
                // Another process took the port between our probe and the server's bind.
                Err(Error::PortInUse { .. }) if attempt < 3 => attempt += 1,
                Err(e) => {
                    server.kill();
                    return Err(e);
                }
            }
        }
    }

    /// The superuser's URL for the `postgres` database, over the unix socket.
    pub fn admin_url(&self) -> &str {
        &self.admin_url
    }
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }
    pub fn server(&self) -> &ChildServer {
        &self.server
    }
}

/// Removes test cluster directories whose owning process and postmaster are both gone.
fn remove_stale_test_clusters(parent: &Path) {
    let own = std::process::id();
    for entry in fs::read_dir(parent).into_iter().flatten().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(parse_test_dir_owner) else { continue };
        if pid == own || process_alive(pid) {
            continue;
        }
        let postmaster = fs::read_to_string(entry.path().join("data/postmaster.pid")).ok();
        if postmaster.and_then(|s| s.lines().next()?.trim().parse().ok()).is_some_and(process_alive) {
            continue;
        }
        let _ = fs::remove_dir_all(entry.path());
    }
}

fn process_alive(pid: u32) -> bool {
    Path::new("/proc").join(pid.to_string()).exists()
}

/// The owner pid in a test cluster directory name `innerwall-pgtest-<pid>-<random>`.
fn parse_test_dir_owner(name: &str) -> Option<u32> {
    let (pid, random) = name.strip_prefix(TEST_DIR_PREFIX)?.split_once('-')?;
    if random.is_empty() {
        return None;
    }
    pid.parse().ok()
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

/// A free TCP port on 127.0.0.1, as chosen by the kernel for a wildcard bind.
pub fn pick_free_port() -> Result<u16, Error> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(io_error("bind", "127.0.0.1:0"))?;
    let port = listener.local_addr().map_err(io_error("bind", "127.0.0.1:0"))?.port();
    Ok(port)
}

/// The content of a port file: one non-zero port number.
pub fn parse_port(content: &str) -> Option<u16> {
    content.trim().parse().ok().filter(|port| *port != 0)
}

/// `postgres://user:password@127.0.0.1:port/database`. The user, password and database are ours,
/// alphanumeric and `_`, so need no percent-encoding.
pub fn database_url(user: &str, password: &str, port: u16, database: &str) -> String {
    format!("postgres://{user}:{password}@127.0.0.1:{port}/{database}")
}

/// The URL of `database` over the cluster's unix socket in `socket_dir`, where the superuser
/// needs no password (see [`Cluster::init`]). The port names the socket file.
pub fn socket_url(user: &str, socket_dir: &Path, port: u16, database: &str) -> String {
    let mut dir = String::new();
    for byte in socket_dir.as_os_str().as_encoded_bytes() {
        match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'/' | b'-' | b'_' | b'.' => {
                dir.push(char::from(*byte))
            }
            _ => dir.push_str(&format!("%{byte:02X}")),
        }
    }
    format!("postgres://{user}@localhost:{port}/{database}?host={dir}")
}

/// `url` with its database (path) replaced by `database`, keeping the query string.
pub fn with_database(url: &str, database: &str) -> String {
    let authority_start = url.find("://").map_or(0, |i| i + 3);
    let rest = &url[authority_start..];
    let authority_end = rest.find(['/', '?']).map_or(url.len(), |i| authority_start + i);
    let query = url[authority_end..].find('?').map_or("", |i| &url[authority_end + i..]);
    format!("{}/{database}{query}", &url[..authority_end])
}

/// `url` with its password replaced by `***`, for messages.
pub fn redact_url(url: &str) -> String {
    let authority_start = url.find("://").map_or(0, |i| i + 3);
    let rest = &url[authority_start..];
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let Some(at) = authority.rfind('@') else { return url.to_owned() };
    let Some(colon) = authority[..at].find(':') else { return url.to_owned() };
    format!("{}{}:***{}", &url[..authority_start], &authority[..colon], &url[authority_start + at..])
}

/// `name` as a double-quoted SQL identifier.
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
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
    fn port_file() {
        fn check(content: &str, expected: Option<u16>) {
            assert_eq!(parse_port(content), expected, "{content:?}");
        }
        check("5432\n", Some(5432));
        check("  61000  ", Some(61000));
        check("0\n", None);
        check("65536", None);
        check("", None);
        check("54x", None);
    }

    #[test]
    fn urls() {
        assert_eq!(database_url("iw", "pw", 5999, "innerwall"), "postgres://iw:pw@127.0.0.1:5999/innerwall");
        fn check(url: &str, expected: &str) {
            assert_eq!(with_database(url, "iw_test_1"), expected, "{url}");
        }
        check("postgres://u:p@h:5/postgres", "postgres://u:p@h:5/iw_test_1");
        check("postgres://u:p@h:5", "postgres://u:p@h:5/iw_test_1");
        check("postgres://u:p@h:5/", "postgres://u:p@h:5/iw_test_1");
        check("postgres://h/db?sslmode=disable", "postgres://h/iw_test_1?sslmode=disable");
        check("postgres://h?sslmode=disable", "postgres://h/iw_test_1?sslmode=disable");
        check(
            "postgres://u@localhost:5/postgres?host=/tmp/r",
            "postgres://u@localhost:5/iw_test_1?host=/tmp/r",
        );
        assert_eq!(
            socket_url("iw", Path::new("/tmp/a b/run"), 5999, "postgres"),
            "postgres://iw@localhost:5999/postgres?host=/tmp/a%20b/run"
        );
    }

    #[test]
    fn redaction() {
        fn check(url: &str, expected: &str) {
            assert_eq!(redact_url(url), expected, "{url}");
        }
        check("postgres://u:secret@h:5/db", "postgres://u:***@h:5/db");
        check("postgres://u@h:5/db", "postgres://u@h:5/db");
        check("postgres://h:5/db?user=x", "postgres://h:5/db?user=x");
        check("postgres://u:p@ss@h/db", "postgres://u:***@h/db");
    }

    #[test]
    fn test_dir_owner() {
        assert_eq!(parse_test_dir_owner("innerwall-pgtest-1234-abcd0123"), Some(1234));
        assert_eq!(parse_test_dir_owner("innerwall-pgtest-1234-"), None);
        assert_eq!(parse_test_dir_owner("innerwall-pgtest-x-abcd"), None);
        assert_eq!(parse_test_dir_owner("other-1234-abcd"), None);
    }

    #[test]
    fn passwd_line() {
        assert_eq!(
            parse_passwd_line("innerwall:x:998:998::/home/innerwall:/usr/sbin/nologin"),
            Some((998, 998))
        );
        assert_eq!(parse_passwd_line("broken:x:"), None);
    }

    #[test]
    fn config_quotes_the_socket_dir() {
        assert!(server_config(Path::new("/tmp/it's")).contains("unix_socket_directories = '/tmp/it''s'"));
    }

    #[test]
    fn identifiers_are_quoted() {
        assert_eq!(quote_ident("iw_test"), "\"iw_test\"");
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
    }
}
