//! Backups (issue 32, item 4): one file holding what a control plane needs to come back — the
//! database (`pg_dump`'s custom format), the CA directory, and the configuration file — with a
//! manifest that names each member's SHA-256, written as a tar archive with mode 0600.
//! [`verify`] reads a backup as hostile input (member names, count and sizes bounded, every
//! hash checked, the dump listed by `pg_restore`); [`restore`] verifies first, then writes the
//! CA (refusing to replace another one) and the database (refusing a database that holds a
//! control plane already), and records itself in the restored audit log. [`before_migrating`]
//! is the dump `serve` and `migrate` take before applying new migrations.
//!
//! With a passphrase the archive is sealed ([`seal`]: ChaCha20-Poly1305 in chunks, the key from
//! PBKDF2), and opening it needs the passphrase; a sealed file says so in its first bytes.
//!
//! `pg_dump` and `pg_restore` are PostgreSQL's own, from the directory the embedded cluster's
//! binaries come from (the newest installed version, which reads any older server).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};
use sqlx::PgPool;

pub mod seal;

use crate::audit;
use crate::identity::ca::hex;
use crate::postgres::Binaries;

/// The manifest's format; a later one is refused by this build.
pub const FORMAT: u32 = 1;
/// Members of an archive at most (the manifest, the dump, the CA's files, the configuration).
const MAX_MEMBERS: usize = 32;
/// The largest CA file, configuration file or manifest in a backup.
const MAX_SMALL_MEMBER: u64 = 1024 * 1024;
const MANIFEST: &str = "manifest.json";
const DATABASE: &str = "database.dump";
const CA_PREFIX: &str = "ca/";
const CONFIG_PREFIX: &str = "config/";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Invalid(String),
    #[error("{action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("`{command}` failed: {output}")]
    Tool { command: String, output: String },
    #[error(transparent)]
    Postgres(#[from] crate::postgres::Error),
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
    #[error(transparent)]
    Store(#[from] crate::error::Error),
}

fn io_error<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> Error + 'a {
    move |source| Error::Io { action, path: path.to_owned(), source }
}

/// What a backup holds, as its manifest says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    pub created_at: chrono::DateTime<chrono::Utc>,
    /// The `innerwall` version that wrote it.
    pub version: String,
    /// The newest migration the database had applied.
    pub schema_version: i64,
    pub workloads: i64,
    /// Each member but the manifest: its name in the archive, bytes and SHA-256 (hex).
    pub members: Vec<Member>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub name: String,
    pub bytes: u64,
    pub sha256: String,
}

/// Where a backup's parts come from, or go.
#[derive(Debug, Clone)]
pub struct Sources<'a> {
    pub database_url: &'a str,
    pub ca_dir: &'a Path,
    /// The configuration file, when there is one.
    pub config: Option<&'a Path>,
}

/// Reports a long operation's steps (a terminal shows them as they come).
pub type Progress<'a> = &'a dyn Fn(&str);

fn file_sha256(path: &Path) -> Result<(u64, String), Error> {
    let mut file = File::open(path).map_err(io_error("opening", path))?;
    let mut context = ring::digest::Context::new(&ring::digest::SHA256);
    let mut buf = vec![0u8; 1 << 16];
    let mut total = 0u64;
    loop {
        let n = file.read(&mut buf).map_err(io_error("reading", path))?;
        if n == 0 {
            break;
        }
        total += n as u64;
        context.update(&buf[..n]);
    }
    Ok((total, hex(context.finish().as_ref())))
}

fn tool(name: &str) -> Result<PathBuf, Error> {
    Ok(Binaries::find()?.dir().join(name))
}

fn run(command: &mut Command) -> Result<Vec<u8>, Error> {
    let line = format!("{command:?}");
    let out = command.output().map_err(|e| Error::Tool { command: line.clone(), output: e.to_string() })?;
    if !out.status.success() {
        let output = String::from_utf8_lossy(&out.stderr).trim().to_owned();
        return Err(Error::Tool { command: line, output: crate::postgres::redact_url(&output) });
    }
    Ok(out.stdout)
}

/// `pg_dump --format=custom` of `url` into `path` (created with mode 0600).
fn dump(url: &str, path: &Path) -> Result<(), Error> {
    let file = private_file(path)?;
    drop(file);
    run(Command::new(tool("pg_dump")?)
        .args(["--format=custom", "--no-owner", "--no-privileges", "--file"])
        .arg(path)
        .arg(format!("--dbname={url}")))?;
    Ok(())
}

/// Creates `path` for writing with mode 0600, refusing one that exists.
fn private_file(path: &Path) -> Result<File, Error> {
    OpenOptions::new().write(true).create_new(true).mode(0o600).open(path).map_err(io_error("creating", path))
}

async fn schema_version(pool: &PgPool) -> Result<i64, Error> {
    Ok(sqlx::query_scalar("SELECT COALESCE(max(version), 0) FROM _sqlx_migrations WHERE success")
        .fetch_one(pool)
        .await?)
}

/// Writes a backup of `sources` to `out` (a new file, mode 0600) and records it in the audit
/// log as `actor`.
pub async fn create(
    pool: &PgPool,
    actor: &str,
    sources: &Sources<'_>,
    out: &Path,
    passphrase: Option<&[u8]>,
    progress: Progress<'_>,
) -> Result<Manifest, Error> {
    if let Some(p) = passphrase
        && p.len() < seal::MIN_PASSPHRASE
    {
        return Err(Error::Invalid(format!(
            "the passphrase is shorter than {} bytes: a backup holds the CA's key",
            seal::MIN_PASSPHRASE
        )));
    }
    if out.exists() {
        return Err(Error::Invalid(format!("{} exists: a backup never replaces a file", out.display())));
    }
    let schema_version = schema_version(pool).await?;
    let workloads: i64 = sqlx::query_scalar("SELECT count(*) FROM workloads").fetch_one(pool).await?;
    let mut tx = pool.begin().await?;
    audit::write(&mut tx, &audit::Record::new(actor, "backup.create", &out.display().to_string())).await?;
    tx.commit().await?;
    let staging = out.with_extension("partial");
    fs::create_dir(&staging).map_err(io_error("creating", &staging))?;
    fs::set_permissions(&staging, fs::Permissions::from_mode(0o700))
        .map_err(io_error("securing", &staging))?;
    let made = (|| {
        progress("dumping the database");
        let dump_path = staging.join(DATABASE);
        dump(sources.database_url, &dump_path)?;
        let mut files: Vec<(String, PathBuf)> = vec![(DATABASE.to_owned(), dump_path)];
        let mut ca_files: Vec<PathBuf> = fs::read_dir(sources.ca_dir)
            .map_err(io_error("reading", sources.ca_dir))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file())
            .collect();
        ca_files.sort();
        if ca_files.is_empty() {
            return Err(Error::Invalid(format!("{} holds no CA files", sources.ca_dir.display())));
        }
        for path in ca_files {
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_owned();
            files.push((format!("{CA_PREFIX}{name}"), path));
        }
        if let Some(config) = sources.config {
            let name = config.file_name().and_then(|n| n.to_str()).unwrap_or("innerwall.toml").to_owned();
            files.push((format!("{CONFIG_PREFIX}{name}"), config.to_owned()));
        }
        progress("hashing");
        let mut members = Vec::new();
        for (name, path) in &files {
            let (bytes, sha256) = file_sha256(path)?;
            members.push(Member { name: name.clone(), bytes, sha256 });
        }
        let manifest = Manifest {
            format: FORMAT,
            created_at: chrono::Utc::now(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            schema_version,
            workloads,
            members,
        };
        progress("writing the archive");
        let file = io::BufWriter::new(private_file(out)?);
        let sink = match passphrase {
            Some(p) => Sink::Sealed(Box::new(
                seal::Writer::new(file, p, seal::ROUNDS).map_err(io_error("sealing", out))?,
            )),
            None => Sink::Plain(file),
        };
        let mut archive = tar::Builder::new(sink);
        let manifest_bytes =
            serde_json::to_vec_pretty(&manifest).map_err(|e| Error::Invalid(e.to_string()))?;
        append(&mut archive, MANIFEST, &mut manifest_bytes.as_slice(), manifest_bytes.len() as u64, out)?;
        for (name, path) in &files {
            let mut file = File::open(path).map_err(io_error("opening", path))?;
            let len = file.metadata().map_err(io_error("reading", path))?.len();
            append(&mut archive, name, &mut file, len, out)?;
        }
        let mut writer = archive
            .into_inner()
            .map_err(io_error("writing", out))?
            .finish()
            .map_err(io_error("writing", out))?;
        writer.flush().map_err(io_error("writing", out))?;
        writer.get_ref().sync_all().map_err(io_error("syncing", out))?;
        Ok(manifest)
    })();
    let _ = fs::remove_dir_all(&staging);
    if made.is_err() {
        let _ = fs::remove_file(out);
    }
    made
}

/// Where an archive is written: the file, or a seal over it.
enum Sink {
    Plain(io::BufWriter<File>),
    Sealed(Box<seal::Writer<io::BufWriter<File>>>),
}

impl Sink {
    fn finish(self) -> io::Result<io::BufWriter<File>> {
        match self {
            Sink::Plain(file) => Ok(file),
            Sink::Sealed(sealed) => sealed.finish(),
        }
    }
}

impl Write for Sink {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        match self {
            Sink::Plain(file) => file.write(data),
            Sink::Sealed(sealed) => sealed.write(data),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Sink::Plain(file) => file.flush(),
            Sink::Sealed(sealed) => sealed.flush(),
        }
    }
}

/// Whether `file` is a sealed backup (its first bytes say so).
pub fn is_sealed(file: &Path) -> Result<bool, Error> {
    let mut head = [0u8; seal::MAGIC.len()];
    let mut f = File::open(file).map_err(io_error("opening", file))?;
    let n = f.read(&mut head).map_err(io_error("reading", file))?;
    Ok(n == head.len() && &head == seal::MAGIC)
}

fn append(
    archive: &mut tar::Builder<impl Write>,
    name: &str,
    data: &mut impl Read,
    len: u64,
    out: &Path,
) -> Result<(), Error> {
    let mut header = tar::Header::new_gnu();
    header.set_size(len);
    header.set_mode(0o600);
    header.set_mtime(0);
    archive.append_data(&mut header, name, data).map_err(io_error("writing", out))
}

/// A backup read and checked, its members in `dir` (which the caller removes).
#[derive(Debug)]
pub struct Opened {
    pub manifest: Manifest,
    pub dir: PathBuf,
}

/// Reads the backup `file` into a new private directory beside `scratch` and checks it: the
/// members are exactly the manifest's (names, sizes, hashes), the CA holds a certificate and a
/// key, and `pg_restore` can list the dump. Nothing outside that directory is written.
/// A sealed backup needs `passphrase`; a plain one refuses it (the file is not the one meant).
pub fn open(
    file: &Path,
    scratch: &Path,
    passphrase: Option<&[u8]>,
    progress: Progress<'_>,
) -> Result<Opened, Error> {
    let invalid = |what: &str| Error::Invalid(format!("{}: {what}", file.display()));
    let reader = io::BufReader::new(File::open(file).map_err(io_error("opening", file))?);
    let source: Box<dyn Read> = match (is_sealed(file)?, passphrase) {
        (true, Some(p)) => Box::new(seal::Reader::new(reader, p).map_err(|e| invalid(&e.to_string()))?),
        (true, None) => {
            return Err(invalid("the backup is encrypted: give its passphrase (--passphrase-file)"));
        }
        (false, Some(_)) => return Err(invalid("the backup is not encrypted, yet a passphrase was given")),
        (false, None) => Box::new(reader),
    };
    let dir = scratch.join(format!("innerwall-backup-{}", uuid::Uuid::new_v4()));
    fs::create_dir_all(&dir).map_err(io_error("creating", &dir))?;
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).map_err(io_error("securing", &dir))?;
    match read_members(file, source, &dir, progress) {
        Ok(manifest) => Ok(Opened { manifest, dir }),
        Err(e) => {
            let _ = fs::remove_dir_all(&dir);
            Err(e)
        }
    }
}

fn read_members(
    file: &Path,
    source: impl Read,
    dir: &Path,
    progress: Progress<'_>,
) -> Result<Manifest, Error> {
    let invalid = |what: String| Error::Invalid(format!("{} is not a usable backup: {what}", file.display()));
    progress("reading the archive");
    let mut archive = tar::Archive::new(source);
    let mut manifest: Option<Manifest> = None;
    let mut seen: Vec<Member> = Vec::new();
    for (index, entry) in archive.entries().map_err(|e| invalid(e.to_string()))?.enumerate() {
        if index >= MAX_MEMBERS {
            return Err(invalid(format!("more than {MAX_MEMBERS} members")));
        }
        let mut entry = entry.map_err(|e| invalid(e.to_string()))?;
        if entry.header().entry_type() != tar::EntryType::Regular {
            return Err(invalid("a member that is not a plain file".to_owned()));
        }
        let name = entry.path().map_err(|e| invalid(e.to_string()))?.to_string_lossy().into_owned();
        let size = entry.size();
        let allowed = name == MANIFEST
            || name == DATABASE
            || [CA_PREFIX, CONFIG_PREFIX].iter().any(|p| {
                name.strip_prefix(p).is_some_and(|rest| {
                    !rest.is_empty()
                        && rest.len() <= 64
                        && rest.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
                        && !rest.starts_with('.')
                })
            });
        if !allowed {
            return Err(invalid(format!("unexpected member {name:?}")));
        }
        if name != DATABASE && size > MAX_SMALL_MEMBER {
            return Err(invalid(format!("{name} is larger than {MAX_SMALL_MEMBER} bytes")));
        }
        if name == MANIFEST {
            if manifest.is_some() || index != 0 {
                return Err(invalid("the manifest must come first, once".to_owned()));
            }
            let mut text = Vec::new();
            entry.read_to_end(&mut text).map_err(|e| invalid(e.to_string()))?;
            let parsed: Manifest =
                serde_json::from_slice(&text).map_err(|e| invalid(format!("its manifest: {e}")))?;
            if parsed.format > FORMAT {
                return Err(invalid(format!(
                    "format {} is newer than this build's ({FORMAT})",
                    parsed.format
                )));
            }
            manifest = Some(parsed);
            continue;
        }
        let Some(expected) = manifest.as_ref() else {
            return Err(invalid("the manifest must come first".to_owned()));
        };
        if seen.iter().any(|m| m.name == name) {
            return Err(invalid(format!("{name} appears twice")));
        }
        let Some(listed) = expected.members.iter().find(|m| m.name == name) else {
            return Err(invalid(format!("{name} is not in the manifest")));
        };
        if listed.bytes != size {
            return Err(invalid(format!("{name} holds {size} bytes, the manifest says {}", listed.bytes)));
        }
        let path = dir.join(name.replace('/', "__"));
        let mut out = private_file(&path)?;
        io::copy(&mut entry, &mut out).map_err(io_error("writing", &path))?;
        let (bytes, sha256) = file_sha256(&path)?;
        if sha256 != listed.sha256 || bytes != listed.bytes {
            return Err(invalid(format!("{name} does not match its SHA-256 in the manifest")));
        }
        seen.push(listed.clone());
    }
    let manifest = manifest.ok_or_else(|| invalid("no manifest".to_owned()))?;
    for member in &manifest.members {
        if !seen.iter().any(|m| m.name == member.name) {
            return Err(invalid(format!("{} is missing", member.name)));
        }
    }
    for needed in [format!("{CA_PREFIX}ca.crt"), format!("{CA_PREFIX}ca.key"), DATABASE.to_owned()] {
        if !seen.iter().any(|m| m.name == needed) {
            return Err(invalid(format!("{needed} is missing")));
        }
    }
    progress("listing the database dump");
    run(Command::new(tool("pg_restore")?).arg("--list").arg(dir.join(DATABASE)))
        .map_err(|e| invalid(format!("its database dump: {e}")))?;
    Ok(manifest)
}

/// Checks the backup `file` ([`open`]) and returns its manifest.
pub fn verify(file: &Path, passphrase: Option<&[u8]>, progress: Progress<'_>) -> Result<Manifest, Error> {
    let opened = open(file, &std::env::temp_dir(), passphrase, progress)?;
    let _ = fs::remove_dir_all(&opened.dir);
    Ok(opened.manifest)
}

/// Restores the backup `file` into `target`: the CA into its directory (files that differ
/// from an existing CA's are refused: restoring must not replace a live CA), the database into
/// one that holds no control plane yet (unless `force`, which replaces what is there), and the
/// configuration file to `target.config` when given. Records `backup.restore` in the
/// restored audit log as `actor`.
pub async fn restore(
    file: &Path,
    target: &Sources<'_>,
    actor: &str,
    force: bool,
    passphrase: Option<&[u8]>,
    progress: Progress<'_>,
) -> Result<Manifest, Error> {
    let scratch = target.ca_dir.parent().unwrap_or(Path::new("/tmp"));
    let opened = open(file, scratch, passphrase, progress)?;
    let done = restore_opened(&opened, file, target, actor, force, progress).await;
    let _ = fs::remove_dir_all(&opened.dir);
    done.map(|()| opened.manifest)
}

async fn restore_opened(
    opened: &Opened,
    file: &Path,
    target: &Sources<'_>,
    actor: &str,
    force: bool,
    progress: Progress<'_>,
) -> Result<(), Error> {
    let member = |name: &str| opened.dir.join(name.replace('/', "__"));
    // Every check before anything is written.
    let ca: Vec<(&str, PathBuf)> = opened
        .manifest
        .members
        .iter()
        .filter_map(|m| Some((m.name.strip_prefix(CA_PREFIX)?, member(&m.name))))
        .collect();
    for (name, path) in &ca {
        let existing = target.ca_dir.join(name);
        if existing.exists() && fs::read(&existing).ok() != fs::read(path).ok() && !force {
            return Err(Error::Invalid(format!(
                "{} exists and differs from the backup's: restoring does not replace a CA (--force does)",
                existing.display()
            )));
        }
    }
    let pool = crate::postgres::pool_options().connect(target.database_url).await.map_err(|source| {
        crate::postgres::Error::Connect { url: crate::postgres::redact_url(target.database_url), source }
    })?;
    let populated: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM information_schema.tables WHERE table_schema = 'public' AND table_name = 'workloads')",
    )
    .fetch_one(&pool)
    .await?;
    if populated && !force {
        return Err(Error::Invalid(
            "the database already holds a control plane: restore into an empty database (--force replaces it)"
                .to_owned(),
        ));
    }
    if let Some(config) = target.config
        && config.exists()
        && !force
    {
        return Err(Error::Invalid(format!(
            "{} exists: restoring does not replace it (--force does)",
            config.display()
        )));
    }
    if populated {
        progress("clearing the database");
        sqlx::query("DROP SCHEMA public CASCADE").execute(&pool).await?;
        sqlx::query("CREATE SCHEMA public").execute(&pool).await?;
    }
    progress("restoring the database");
    run(Command::new(tool("pg_restore")?)
        .args(["--no-owner", "--no-privileges", "--single-transaction", "--exit-on-error"])
        .arg(format!("--dbname={}", target.database_url))
        .arg(member(DATABASE)))?;
    progress("restoring the CA");
    fs::create_dir_all(target.ca_dir).map_err(io_error("creating", target.ca_dir))?;
    fs::set_permissions(target.ca_dir, fs::Permissions::from_mode(0o700))
        .map_err(io_error("securing", target.ca_dir))?;
    for (name, path) in &ca {
        let to = target.ca_dir.join(name);
        let bytes = fs::read(path).map_err(io_error("reading", path))?;
        let _ = fs::remove_file(&to);
        private_file(&to)?.write_all(&bytes).map_err(io_error("writing", &to))?;
    }
    if let Some(config) = target.config
        && let Some(m) = opened.manifest.members.iter().find(|m| m.name.starts_with(CONFIG_PREFIX))
    {
        progress("restoring the configuration file");
        let bytes = fs::read(member(&m.name)).map_err(io_error("reading", &member(&m.name)))?;
        let _ = fs::remove_file(config);
        private_file(config)?.write_all(&bytes).map_err(io_error("writing", config))?;
    }
    let mut tx = pool.begin().await?;
    audit::write(&mut tx, &audit::Record::new(actor, "backup.restore", &file.display().to_string())).await?;
    tx.commit().await?;
    pool.close().await;
    Ok(())
}

/// Before new migrations are applied to `url`'s database, a dump of it into `dir`
/// (`before-migration-<from>-<time>.dump`, mode 0600); `None` when nothing is pending or the
/// database is new.
pub async fn before_migrating(url: &str, dir: &Path) -> Result<Option<PathBuf>, Error> {
    use sqlx::Connection as _;
    let mut conn = sqlx::PgConnection::connect(url).await.map_err(|source| {
        crate::postgres::Error::Connect { url: crate::postgres::redact_url(url), source }
    })?;
    let applied = crate::postgres::applied(&mut conn).await?;
    let _ = conn.close().await;
    let plan = crate::postgres::plan_build(&applied);
    // A new database has nothing to keep; a history this build cannot serve is refused by the
    // migration that follows, which this dump would not help.
    let Some(applied) = applied.iter().map(|a| a.version).max() else { return Ok(None) };
    if !matches!(plan, Ok(crate::postgres::Plan::Behind { .. })) {
        return Ok(None);
    }
    fs::create_dir_all(dir).map_err(io_error("creating", dir))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(io_error("securing", dir))?;
    let path =
        dir.join(format!("before-migration-{applied}-{}.dump", chrono::Utc::now().format("%Y%m%dT%H%M%SZ")));
    dump(url, &path)?;
    Ok(Some(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_is_the_known_digest() {
        let digest = ring::digest::digest(&ring::digest::SHA256, b"abc");
        assert_eq!(hex(digest.as_ref()), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }
}
