//! Backups through the real binary (issue 32, item 4): what `backup create` writes, `verify`
//! refusing damaged and hostile archives, `restore` refusing to replace a control plane or
//! another CA and restoring into an empty one, and the dump taken before new migrations.

use std::borrow::Cow;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use innerwall_control_plane::flows;
use innerwall_control_plane::identity::ca::{FileCa, Signer as _};
use innerwall_control_plane::postgres::MIGRATOR;
use innerwall_control_plane::testing::fresh_database;
use sqlx::PgPool;

/// `innerwall --database-url URL --ca-dir CA ARGS`: (exit status, stdout, stderr).
fn innerwall(url: &str, ca: &Path, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_innerwall"))
        .env_remove("INNERWALL_CONFIG")
        .env_remove("INNERWALL_DATABASE_URL")
        .args(["--database-url", url, "--ca-dir"])
        .arg(ca)
        .args(args)
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code().unwrap_or(-1), text(&out.stdout), text(&out.stderr))
}

fn ok(url: &str, ca: &Path, args: &[&str]) -> String {
    let (code, out, err) = innerwall(url, ca, args);
    assert_eq!(code, 0, "{args:?}: {out}{err}");
    out
}

async fn services(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT name FROM services ORDER BY name").fetch_all(pool).await.unwrap()
}

/// A window of one record from workload `w0` starting at `start`, its id the digest of `window`.
async fn add_window(pool: &PgPool, start: chrono::DateTime<chrono::Utc>, window: &str) {
    let mut tx = pool.begin().await.unwrap();
    flows::ensure_partitions(&mut tx, start, start).await.unwrap();
    tx.commit().await.unwrap();
    sqlx::query(
        "WITH w AS (
            INSERT INTO flow_windows (workload_id, window_id, window_start, window_end, policy_version, mode,
                record_count, gap_count)
            VALUES (md5('w0')::uuid, md5($2)::uuid, $1, $1 + interval '60 seconds', 1, 2, 1, 0))
         INSERT INTO flow_records (workload_id, window_id, window_start, policy_version, src_address, dst_address,
             dst_port, protocol, decision, matched_rule_id, packets, bytes, new_connections, first_seen, last_seen,
             peer_kind, peer_key, peer_labels, ordinal)
         VALUES (md5('w0')::uuid, md5($2)::uuid, $1, 1, '192.0.2.1', '10.0.0.1', 443, 1, 3, '', 1, 60, 1, $1, $1,
                 0, '192.0.2.1', '{}', 0)",
    )
    .bind(start)
    .bind(window)
    .execute(pool)
    .await
    .unwrap();
}

/// Every row of the map's edges, label sets and both queues of windows, as text.
async fn flow_evidence(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT 'flow_edge_hours ' || e::text FROM flow_edge_hours e
         UNION ALL SELECT 'flow_label_sets ' || s::text FROM flow_label_sets s
         UNION ALL SELECT 'flow_edge_pending ' || q::text FROM flow_edge_pending q
         UNION ALL SELECT 'flow_pending_windows ' || q::text FROM flow_pending_windows q
         ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// A tar archive of `members` (name, bytes), written to `path`.
fn archive(path: &Path, members: &[(&str, &[u8])]) {
    let mut builder = tar::Builder::new(std::fs::File::create(path).unwrap());
    for (name, bytes) in members {
        let mut header = tar::Header::new_gnu();
        header.set_size(bytes.len() as u64);
        header.set_mode(0o600);
        // `append_data` refuses "..": write the name into the header by hand, as an attacker would.
        header.as_gnu_mut().unwrap().name[..name.len()].copy_from_slice(name.as_bytes());
        header.set_cksum();
        builder.append(&header, *bytes).unwrap();
    }
    builder.finish().unwrap();
}

/// The members of the tar archive at `path`: (name, bytes).
fn members(path: &Path) -> Vec<(String, Vec<u8>)> {
    let mut archive = tar::Archive::new(std::fs::File::open(path).unwrap());
    archive
        .entries()
        .unwrap()
        .map(|e| {
            let mut e = e.unwrap();
            let name = e.path().unwrap().to_string_lossy().into_owned();
            let mut bytes = Vec::new();
            std::io::Read::read_to_end(&mut e, &mut bytes).unwrap();
            (name, bytes)
        })
        .collect()
}

#[tokio::test]
async fn backups_are_checked() {
    let source = fresh_database().await.unwrap();
    let dir = std::env::temp_dir().join(format!("iw-backup-it-{}", uuid::Uuid::new_v4()));
    let ca = dir.join("ca");
    let signer = FileCa::init(&ca).unwrap();
    let config = dir.join("innerwall.toml");
    std::fs::write(&config, "log-level = \"info\"\n").unwrap();
    ok(&source.url, &ca, &["service", "create", "web", "--entry", "tcp:80"]);
    // Flow evidence with a window summed for the map and one still queued: restored, the
    // triggers (queueing windows, keeping foreign edge rows out) come after the data, so they
    // neither queue a window again nor drop an edge.
    let start = chrono::Utc::now() - chrono::Duration::hours(2);
    sqlx::query("INSERT INTO workloads (id, hostname) VALUES (md5('w0')::uuid, 'host-0')")
        .execute(&source.pool)
        .await
        .unwrap();
    add_window(&source.pool, start, "x0").await;
    assert_eq!(flows::sum_edges(&source.pool).await.unwrap(), 1);
    add_window(&source.pool, start + chrono::Duration::minutes(1), "x1").await;
    let evidence = flow_evidence(&source.pool).await;
    assert_eq!(evidence.iter().filter(|r| r.starts_with("flow_edge_hours")).count(), 1, "{evidence:?}");

    // Create: a new file of mode 0600 with the manifest first; never over an existing file.
    let file = dir.join("cp.backup");
    let path = file.to_str().unwrap();
    let config_arg = config.to_str().unwrap();
    let said = ok(&source.url, &ca, &["--config", config_arg, "backup", "create", path]);
    assert!(said.starts_with(&format!("backup {path}:")), "{said}");
    assert_eq!(std::fs::metadata(&file).unwrap().permissions().mode() & 0o777, 0o600);
    let inside = members(&file);
    let names: Vec<&str> = inside.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names[0], "manifest.json");
    for expected in ["database.dump", "ca/ca.crt", "ca/ca.key", "config/innerwall.toml"] {
        assert!(names.contains(&expected), "{names:?}");
    }
    let (code, _, err) = innerwall(&source.url, &ca, &["backup", "create", path]);
    assert_eq!(code, 1);
    assert!(err.contains("exists"), "{err}");
    let said = ok(&source.url, &ca, &["--json", "backup", "verify", path]);
    let doc: serde_json::Value = serde_json::from_str(&said).unwrap();
    assert_eq!(doc["manifest"]["members"].as_array().unwrap().len(), 4, "{doc}");

    // Damaged and hostile archives are refused by verify, naming what is wrong.
    let refused = |bytes_of: &dyn Fn() -> PathBuf, expected: &str| {
        let bad = bytes_of();
        let (code, out, err) = innerwall(&source.url, &ca, &["backup", "verify", bad.to_str().unwrap()]);
        assert_eq!(code, 1, "{out}");
        assert!(err.contains(expected), "expected {expected:?} in: {err}");
    };
    let whole = std::fs::read(&file).unwrap();
    refused(
        &|| {
            let p = dir.join("truncated");
            std::fs::write(&p, &whole[..whole.len() / 2]).unwrap();
            p
        },
        "not a usable backup",
    );
    refused(
        &|| {
            let p = dir.join("tampered");
            let mut edited = inside.clone();
            let key = edited.iter_mut().find(|(n, _)| n == "ca/ca.key").unwrap();
            key.1[40] ^= 1;
            let list: Vec<(&str, &[u8])> = edited.iter().map(|(n, b)| (n.as_str(), b.as_slice())).collect();
            archive(&p, &list);
            p
        },
        "ca/ca.key does not match its SHA-256",
    );
    refused(
        &|| {
            let p = dir.join("escaping");
            let mut list: Vec<(&str, &[u8])> =
                inside.iter().map(|(n, b)| (n.as_str(), b.as_slice())).collect();
            list.push(("ca/../../etc/cron.d/x", b"* * * * * root true\n"));
            archive(&p, &list);
            p
        },
        "unexpected member",
    );
    refused(
        &|| {
            let p = dir.join("no-manifest");
            let list: Vec<(&str, &[u8])> =
                inside.iter().skip(1).map(|(n, b)| (n.as_str(), b.as_slice())).collect();
            archive(&p, &list);
            p
        },
        "manifest must come first",
    );

    // Restore refuses a database that holds a control plane, and another CA; nothing changes.
    let other = fresh_database().await.unwrap();
    ok(&other.url, &ca, &["service", "create", "kept", "--entry", "tcp:1"]);
    let (code, _, err) = innerwall(&other.url, &ca, &["backup", "restore", path]);
    assert_eq!(code, 1);
    assert!(err.contains("already holds a control plane"), "{err}");
    assert_eq!(services(&other.pool).await, ["kept"]);
    let other_ca = dir.join("other-ca");
    FileCa::init(&other_ca).unwrap();
    let empty = fresh_database().await.unwrap();
    sqlx::query("DROP SCHEMA public CASCADE").execute(&empty.pool).await.unwrap();
    sqlx::query("CREATE SCHEMA public").execute(&empty.pool).await.unwrap();
    let (code, _, err) = innerwall(&empty.url, &other_ca, &["backup", "restore", path]);
    assert_eq!(code, 1);
    assert!(err.contains("differs from the backup's"), "{err}");
    let tables: i64 =
        sqlx::query_scalar("SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'")
            .fetch_one(&empty.pool)
            .await
            .unwrap();
    assert_eq!(tables, 0, "a refused restore wrote nothing");

    // Into an empty database and CA directory: everything comes back, and the log says so.
    let fresh_ca = dir.join("fresh-ca");
    let config_out = dir.join("restored.toml");
    let said =
        ok(&empty.url, &fresh_ca, &["backup", "restore", path, "--config-out", config_out.to_str().unwrap()]);
    assert!(said.starts_with("restored"), "{said}");
    empty.pool.close().await;
    let restored = innerwall_control_plane::postgres::pool_options().connect(&empty.url).await.unwrap();
    assert_eq!(services(&restored).await, ["web"]);
    assert_eq!(flow_evidence(&restored).await, evidence);
    assert_eq!(FileCa::load(&fresh_ca).unwrap().ca_bundle_pem(), signer.ca_bundle_pem());
    assert_eq!(std::fs::metadata(fresh_ca.join("ca.key")).unwrap().permissions().mode() & 0o777, 0o600);
    assert_eq!(std::fs::read_to_string(&config_out).unwrap(), "log-level = \"info\"\n");
    let actions: Vec<String> =
        sqlx::query_scalar("SELECT action FROM audit_log WHERE action LIKE 'backup.%' ORDER BY id")
            .fetch_all(&restored)
            .await
            .unwrap();
    assert_eq!(actions, ["backup.create", "backup.restore"]);
    // The second time: refused, the database holds a control plane now.
    let (code, _, err) = innerwall(&empty.url, &fresh_ca, &["backup", "restore", path]);
    assert_eq!(code, 1, "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn new_migrations_are_preceded_by_a_dump() {
    let db = fresh_database().await.unwrap();
    // The schema one migration behind this build's.
    sqlx::query("DROP SCHEMA public CASCADE").execute(&db.pool).await.unwrap();
    sqlx::query("CREATE SCHEMA public").execute(&db.pool).await.unwrap();
    let latest = MIGRATOR.iter().map(|m| m.version).max().unwrap();
    let older = sqlx::migrate::Migrator {
        migrations: Cow::Owned(MIGRATOR.iter().filter(|m| m.version < latest).cloned().collect()),
        ..sqlx::migrate::Migrator::DEFAULT
    };
    older.run(&db.pool).await.unwrap();
    let dir = std::env::temp_dir().join(format!("iw-migrate-dump-{}", uuid::Uuid::new_v4()));
    let state = dir.join("state");
    let ca = dir.join("ca");
    let (code, out, err) = innerwall(&db.url, &ca, &["--state-dir", state.to_str().unwrap(), "migrate"]);
    assert_eq!(code, 0, "{out}{err}");
    let dumps: Vec<PathBuf> =
        std::fs::read_dir(state.join("backups")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(dumps.len(), 1, "{dumps:?}");
    let name = dumps[0].file_name().unwrap().to_string_lossy().into_owned();
    let from = older.iter().map(|m| m.version).max().unwrap();
    assert!(name.starts_with(&format!("before-migration-{from}-")), "{name}");
    assert!(err.contains(&dumps[0].display().to_string()), "the notice names the dump: {err}");
    assert_eq!(std::fs::metadata(&dumps[0]).unwrap().permissions().mode() & 0o777, 0o600);
    let bin = innerwall_control_plane::postgres::Binaries::find().unwrap();
    let listed = Command::new(bin.dir().join("pg_restore")).arg("--list").arg(&dumps[0]).output().unwrap();
    assert!(listed.status.success() && String::from_utf8_lossy(&listed.stdout).contains("workloads"));
    // Up to date now: the second run dumps nothing.
    let (code, _, err) = innerwall(&db.url, &ca, &["--state-dir", state.to_str().unwrap(), "migrate"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(std::fs::read_dir(state.join("backups")).unwrap().count(), 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `innerwall ARGS` with `input` on its standard input: (exit status, stdout, stderr).
fn innerwall_with_stdin(url: &str, ca: &Path, args: &[&str], input: &str) -> (i32, String, String) {
    use std::io::Write as _;
    let mut child = Command::new(env!("CARGO_BIN_EXE_innerwall"))
        .env_remove("INNERWALL_CONFIG")
        .env_remove("INNERWALL_DATABASE_URL")
        .args(["--database-url", url, "--ca-dir"])
        .arg(ca)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let _ = child.stdin.take().unwrap().write_all(input.as_bytes());
    let out = child.wait_with_output().unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code().unwrap_or(-1), text(&out.stdout), text(&out.stderr))
}

#[tokio::test]
async fn encrypted_backups_need_their_passphrase() {
    let source = fresh_database().await.unwrap();
    let dir = std::env::temp_dir().join(format!("iw-backup-sealed-{}", uuid::Uuid::new_v4()));
    let ca = dir.join("ca");
    FileCa::init(&ca).unwrap();
    ok(&source.url, &ca, &["service", "create", "web", "--entry", "tcp:80"]);
    let passphrase = dir.join("passphrase");
    std::fs::write(&passphrase, "a long enough passphrase\n").unwrap();
    let pass = passphrase.to_str().unwrap();
    let file = dir.join("sealed.backup");
    let path = file.to_str().unwrap();

    // Too short a passphrase: refused before anything is written.
    let (code, _, err) = innerwall_with_stdin(
        &source.url,
        &ca,
        &["backup", "create", path, "--passphrase-file", "-"],
        "short\n",
    );
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("shorter than 12"), "{err}");
    assert!(!file.exists(), "a refused backup left a file");

    // Sealed: not a tar any more (no CA key readable in it), and nothing opens it without the
    // passphrase, or with another; with it, verify and restore work as for a plain one.
    let said = ok(&source.url, &ca, &["backup", "create", path, "--passphrase-file", pass]);
    assert!(said.starts_with(&format!("backup {path}:")), "{said}");
    let bytes = std::fs::read(&file).unwrap();
    assert!(bytes.starts_with(b"innerwall-sealed-v1\n"));
    let key = std::fs::read(ca.join("ca.key")).unwrap();
    assert!(!bytes.windows(32).any(|w| w == &key[40..72]), "the CA key is readable in the sealed file");
    let (code, _, err) = innerwall(&source.url, &ca, &["backup", "verify", path]);
    assert_eq!(code, 1);
    assert!(err.contains("encrypted: give its passphrase (--passphrase-file)"), "{err}");
    let (code, _, err) = innerwall_with_stdin(
        &source.url,
        &ca,
        &["backup", "verify", path, "--passphrase-file", "-"],
        "not the passphrase at all",
    );
    assert_eq!(code, 1);
    assert!(err.contains("the passphrase is wrong, or the file was altered"), "{err}");
    let said = ok(&source.url, &ca, &["backup", "verify", path, "--passphrase-file", pass]);
    assert!(said.starts_with("verified"), "{said}");

    let empty = fresh_database().await.unwrap();
    sqlx::query("DROP SCHEMA public CASCADE").execute(&empty.pool).await.unwrap();
    sqlx::query("CREATE SCHEMA public").execute(&empty.pool).await.unwrap();
    let fresh_ca = dir.join("fresh-ca");
    let said = ok(&empty.url, &fresh_ca, &["backup", "restore", path, "--passphrase-file", pass]);
    assert!(said.starts_with("restored"), "{said}");
    let restored = innerwall_control_plane::postgres::pool_options().connect(&empty.url).await.unwrap();
    assert_eq!(services(&restored).await, ["web"]);
    std::fs::remove_dir_all(&dir).unwrap();
}
