//! The test harness's private server: one throw-away cluster per test process under the temp
//! directory, and removal of the clusters that crashed test processes left behind.

use std::fs;
use std::io;
use std::path::Path;

use super::child::ChildServer;
use super::cluster::{Cluster, wait_until_accepting};
use super::url::{pick_free_port, socket_url};
use super::{Error, START_TIMEOUT, SUPERUSER, blocking, io_error};

const TEST_DIR_PREFIX: &str = "innerwall-pgtest-";

/// Settings for a throw-away test server: durability off, room for many parallel tests.
const TEST_SETTINGS: &[(&str, &str)] = &[
    ("fsync", "off"),
    ("synchronous_commit", "off"),
    ("full_page_writes", "off"),
    ("max_connections", "200"),
];

/// The private server of one test process: a cluster under the temp directory whose server
/// dies with the process. The directory stays behind when the process ends without calling
/// [`TestCluster::remove`] (killed outright); the next [`TestCluster::start`] removes directories
/// of processes that are gone.
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

    /// Stops the server (postgres's immediate shutdown), waits until it has exited (at most
    /// [`START_TIMEOUT`], blocking the calling thread) and removes the cluster's directory. A
    /// process-wide cluster is never dropped: the test harness calls this when its process exits
    /// (`testing`).
    pub fn remove(self) -> Result<(), Error> {
        let root = self.cluster.root().to_path_buf();
        self.server.kill();
        let deadline = std::time::Instant::now() + START_TIMEOUT;
        while self.server.exit_status().is_none() {
            if std::time::Instant::now() > deadline {
                return Err(io_error("stop the test server of", &root)(io::Error::other(
                    "it is still running",
                )));
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        fs::remove_dir_all(&root).map_err(io_error("remove", &root))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_dir_owner() {
        assert_eq!(parse_test_dir_owner("innerwall-pgtest-1234-abcd0123"), Some(1234));
        assert_eq!(parse_test_dir_owner("innerwall-pgtest-1234-"), None);
        assert_eq!(parse_test_dir_owner("innerwall-pgtest-x-abcd"), None);
        assert_eq!(parse_test_dir_owner("other-1234-abcd"), None);
    }
}
