//! Enrollment and the one mutual-TLS listener over real TLS on loopback (IDN-2..IDN-7): a real
//! token enrolls, the issued certificate is the only identity an agent RPC accepts, and every
//! other credential is refused.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use innerwall_control_plane::admission::Limits;
use innerwall_control_plane::identity::ca::{FileCa, Signer};
use innerwall_control_plane::identity::tokens;
use innerwall_control_plane::policy::authoring;
use innerwall_control_plane::postgres::Pools;
use innerwall_control_plane::service::{self, Running, ServiceConfig};
use innerwall_control_plane::sync::gateway::GatewayConfig;
use innerwall_control_plane::testing::{TestDatabase, fresh_database};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::Mode;

use crate::eventually;
use innerwall_wire::proto::{self, sync_request, sync_response};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

/// A control plane on a fresh database with its own CA, listening on a free loopback port.
pub struct Plane {
    pub db: TestDatabase,
    pub ca_dir: std::path::PathBuf,
    pub signer: Arc<FileCa>,
    pub running: Option<Running>,
    pub limits: Limits,
    /// Lifetime of the workload certificates it issues.
    pub cert_lifetime: Duration,
    /// Lifetime of its listener's own certificate.
    pub server_cert_lifetime: Duration,
}

impl Plane {
    pub async fn start(config: GatewayConfig) -> Plane {
        let db = fresh_database().await.unwrap();
        let ca_dir = std::env::temp_dir().join(format!("iw-ca-{}", uuid::Uuid::new_v4()));
        let signer = Arc::new(FileCa::init(&ca_dir).unwrap());
        let mut plane = Plane {
            db,
            ca_dir,
            signer,
            running: None,
            limits: Limits::default(),
            cert_lifetime: Duration::from_secs(3600),
            server_cert_lifetime: innerwall_control_plane::identity::server_cert::SERVER_CERT_LIFETIME,
        };
        plane.restart(config).await;
        plane
    }

    pub async fn restart(&mut self, gateway: GatewayConfig) {
        if let Some(running) = self.running.take() {
            running.stop().await.unwrap();
        }
        let config = ServiceConfig {
            cert_lifetime: self.cert_lifetime,
            server_cert_lifetime: self.server_cert_lifetime,
            gateway,
            limits: self.limits.clone(),
            ..innerwall_control_plane::testing::loopback_service()
        };
        self.running = Some(
            service::start(Pools::shared(self.db.pool.clone()), self.signer.clone(), config).await.unwrap(),
        );
    }

    pub fn addr(&self) -> String {
        format!("localhost:{}", self.running.as_ref().unwrap().local_addr.port())
    }

    pub fn ca_pem(&self) -> String {
        self.signer.ca_bundle_pem()
    }

    pub async fn mint(&self, labels: &[&str], max_uses: Option<u32>) -> String {
        let labels: Vec<_> = labels.iter().map(|l| l.parse().unwrap()).collect();
        let mut conn = self.db.pool.acquire().await.unwrap();
        tokens::mint(&mut conn, &labels, chrono::Duration::days(1), max_uses, &[]).await.unwrap().secret
    }

    async fn channel(&self, tls: ClientTlsConfig) -> Result<Channel, tonic::transport::Error> {
        Endpoint::from_shared(format!("https://{}", self.addr()))?.tls_config(tls)?.connect().await
    }

    /// Server-authenticated TLS only, as enrollment uses.
    pub async fn anonymous(&self) -> Channel {
        self.channel(
            ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(self.ca_pem()))
                .domain_name("localhost"),
        )
        .await
        .unwrap()
    }

    /// [`Plane::mutual`] whose HTTP/2 receive windows are `window` bytes: a client that does
    /// not read lets the server send that much, then the server waits.
    pub async fn mutual_windowed(&self, cert_pem: &str, key_pem: &str, window: u32) -> Channel {
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(self.ca_pem()))
            .identity(Identity::from_pem(cert_pem, key_pem))
            .domain_name("localhost");
        Endpoint::from_shared(format!("https://{}", self.addr()))
            .unwrap()
            .tls_config(tls)
            .unwrap()
            .initial_stream_window_size(window)
            .initial_connection_window_size(window)
            .connect()
            .await
            .unwrap()
    }

    pub async fn mutual(&self, cert_pem: &str, key_pem: &str) -> Result<Channel, tonic::transport::Error> {
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(self.ca_pem()))
            .identity(Identity::from_pem(cert_pem, key_pem))
            .domain_name("localhost");
        self.channel(tls).await
    }

    pub async fn enroll(&self, token: &str) -> Result<(WorkloadId, String, String), tonic::Status> {
        self.enroll_reporting(token, &["10.1.0.5/24", "fe80::1/64", "127.0.0.1/8"]).await
    }

    /// Enrolls a host whose one interface reports `addresses`.
    pub async fn enroll_reporting(
        &self,
        token: &str,
        addresses: &[&str],
    ) -> Result<(WorkloadId, String, String), tonic::Status> {
        let enrolled = self.enroll_replacing(token, addresses, None, false).await?;
        Ok((enrolled.id, enrolled.cert, enrolled.key))
    }

    /// Enrolls a host reporting `addresses`, presenting `previous` (certificate and key PEM) as
    /// the client certificate, and asking to replace it when `replace`.
    pub async fn enroll_replacing(
        &self,
        token: &str,
        addresses: &[&str],
        previous: Option<(&str, &str)>,
        replace: bool,
    ) -> Result<Enrolled, tonic::Status> {
        let (key_pem, request) = enroll_request(token, addresses, replace);
        let channel = match previous {
            Some((cert, key)) => self.mutual(cert, key).await.unwrap(),
            None => self.anonymous().await,
        };
        let response = proto::enrollment_service_client::EnrollmentServiceClient::new(channel)
            .enroll(request)
            .await?
            .into_inner();
        Ok(Enrolled {
            id: WorkloadId::parse_uri(&response.workload_id).unwrap(),
            cert: String::from_utf8(response.certificate_pem).unwrap(),
            key: key_pem,
            replaced: response.replaced_workload_id,
        })
    }
}

/// What an enrollment returned: the identity and its credential, and the workload it replaced.
pub struct Enrolled {
    pub id: WorkloadId,
    pub cert: String,
    pub key: String,
    pub replaced: String,
}

impl Drop for Plane {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.ca_dir);
    }
}

/// A fresh key and the enrollment request of a host named web-1 whose one interface reports
/// `addresses`, with a CSR for that key.
pub fn enroll_request(token: &str, addresses: &[&str], replace: bool) -> (String, proto::EnrollRequest) {
    let (key_pem, csr_pem) = key_and_csr();
    let facts = proto::HostFacts {
        hostname: "web-1".into(),
        interfaces: vec![proto::NetworkInterface {
            name: "eth0".into(),
            addresses: addresses.iter().map(|a| a.to_string()).collect(),
            mac_address: String::new(),
        }],
        ..Default::default()
    };
    let request = proto::EnrollRequest {
        provisioning_token: token.into(),
        csr_pem,
        facts: Some(facts),
        agent: None,
        replace,
    };
    (key_pem, request)
}

pub fn key_and_csr() -> (String, Vec<u8>) {
    let key = rcgen::KeyPair::generate().unwrap();
    let csr = rcgen::CertificateParams::default().serialize_request(&key).unwrap().pem().unwrap();
    (key.serialize_pem(), csr.into_bytes())
}

/// Opens a Sync stream with Hello and returns the first two messages (HelloAck, snapshot).
async fn open_sync(
    channel: Channel,
) -> Result<
    (
        proto::HelloAck,
        proto::WorkloadPolicy,
        tonic::Streaming<proto::SyncResponse>,
        tokio::sync::mpsc::Sender<proto::SyncRequest>,
    ),
    tonic::Status,
> {
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let hello = proto::Hello { applied_version: 0, ..Default::default() };
    tx.send(proto::SyncRequest { msg: Some(sync_request::Msg::Hello(hello)) }).await.unwrap();
    let mut client = proto::agent_service_client::AgentServiceClient::new(channel);
    let mut inbound = client.sync(tokio_stream::wrappers::ReceiverStream::new(rx)).await?.into_inner();
    let Some(proto::SyncResponse { msg: Some(sync_response::Msg::HelloAck(ack)) }) =
        inbound.message().await?
    else {
        panic!("first message is not HelloAck");
    };
    let Some(proto::SyncResponse { msg: Some(sync_response::Msg::Snapshot(snap)) }) =
        inbound.message().await?
    else {
        panic!("second message is not a snapshot");
    };
    Ok((ack, snap.policy.unwrap(), inbound, tx))
}

#[tokio::test]
async fn mtls_identity_from_certificate() {
    let plane = Plane::start(GatewayConfig::default()).await;
    let token = plane.mint(&["app=web"], None).await;
    let (id, cert, key) = plane.enroll(&token).await.unwrap();

    // The registry has exactly the token's labels and the routable address, and version 1.
    let row: (String, Vec<String>) = sqlx::query_as(
        "SELECT w.hostname, array(SELECT key || '=' || value FROM workload_labels WHERE workload_id = w.id)
         FROM workloads w WHERE w.id = $1",
    )
    .bind(id.uuid())
    .fetch_one(&plane.db.pool)
    .await
    .unwrap();
    assert_eq!(row, ("web-1".to_owned(), vec!["app=web".to_owned()]));
    let addrs: Vec<String> =
        sqlx::query_scalar("SELECT host(address) FROM workload_addresses WHERE workload_id = $1")
            .bind(id.uuid())
            .fetch_all(&plane.db.pool)
            .await
            .unwrap();
    assert_eq!(addrs, ["10.1.0.5"], "loopback and link-local addresses are not peers");

    // With the issued certificate the stream opens, and the handler serves *this* workload.
    let (ack, snapshot, _inbound, _tx) = open_sync(plane.mutual(&cert, &key).await.unwrap()).await.unwrap();
    assert_eq!(ack.heartbeat_interval_seconds, 30);
    assert_eq!(snapshot.version, 1);
    let (state, seen): (i16, bool) =
        sqlx::query_as("SELECT sync_state, last_snapshot_sent_at IS NOT NULL FROM workloads WHERE id = $1")
            .bind(id.uuid())
            .fetch_one(&plane.db.pool)
            .await
            .unwrap();
    assert_eq!((state, seen), (1, true), "the stream's state is recorded on the certificate's workload");

    // Without a client certificate: the connection may open (TLS 1.3) but every agent RPC fails.
    let err = open_sync(plane.anonymous().await).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated, "{err}");
    assert!(err.message().contains("client certificate"), "{err}");

    // A certificate for the same id from another CA, and an expired one from ours, are refused.
    let other_dir = std::env::temp_dir().join(format!("iw-other-ca-{}", uuid::Uuid::new_v4()));
    let other = FileCa::init(&other_dir).unwrap();
    let (key2, csr2) = key_and_csr();
    let foreign = other.issue_workload(id, &csr2, Duration::from_secs(3600), SystemTime::now()).unwrap();
    std::fs::remove_dir_all(&other_dir).ok();
    let hour_ago = SystemTime::now() - Duration::from_secs(7200);
    let expired = plane.signer.issue_workload(id, &csr2, Duration::from_secs(3600), hour_ago).unwrap();
    for (what, cert) in [("another CA", foreign.pem), ("expired", expired.pem)] {
        let refused = match plane.mutual(&cert, &key2).await {
            Err(_) => true,
            Ok(channel) => open_sync(channel).await.is_err(),
        };
        assert!(refused, "a certificate from {what} was accepted");
    }
}

#[tokio::test]
async fn token_rejections_are_distinct() {
    let plane = Plane::start(GatewayConfig::default()).await;
    let once = plane.mint(&["app=web"], Some(1)).await;
    plane.enroll(&once).await.unwrap();
    let revoked = plane.mint(&["app=web"], None).await;
    let id: uuid::Uuid =
        sqlx::query_scalar("SELECT id FROM provisioning_tokens ORDER BY created_at DESC LIMIT 1")
            .fetch_one(&plane.db.pool)
            .await
            .unwrap();
    tokens::revoke(&mut plane.db.pool.acquire().await.unwrap(), id).await.unwrap();
    let expired = plane.mint(&["app=web"], None).await;
    sqlx::query(
        "UPDATE provisioning_tokens SET expires_at = now() - interval '1 minute' WHERE prefix_hint = $1",
    )
    .bind(&expired[3..9])
    .execute(&plane.db.pool)
    .await
    .unwrap();
    let unknown = format!("iw_{}", "A".repeat(43));
    let workloads_before: i64 =
        sqlx::query_scalar("SELECT count(*) FROM workloads").fetch_one(&plane.db.pool).await.unwrap();
    let cases = [
        ("iw_short", "provisioning token malformed"),
        ("nope", "provisioning token malformed"),
        (unknown.as_str(), "provisioning token unknown"),
        (expired.as_str(), "provisioning token expired"),
        (revoked.as_str(), "provisioning token revoked"),
        (once.as_str(), "provisioning token exhausted"),
    ];
    for (token, want) in cases {
        let err = plane.enroll(token).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unauthenticated, "{token}: {err}");
        assert!(err.message().starts_with(want), "{token}: {:?} lacks {want:?}", err.message());
        assert!(
            !err.message().contains(&token[3.min(token.len())..]) || token.len() < 10,
            "the secret is echoed"
        );
    }
    // A garbage CSR with a good token is refused too, and consumes nothing.
    let good = plane.mint(&["app=web"], Some(1)).await;
    let request = proto::EnrollRequest {
        provisioning_token: good.clone(),
        csr_pem: b"not a csr".to_vec(),
        ..Default::default()
    };
    let err = proto::enrollment_service_client::EnrollmentServiceClient::new(plane.anonymous().await)
        .enroll(request)
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
    let after: i64 =
        sqlx::query_scalar("SELECT count(*) FROM workloads").fetch_one(&plane.db.pool).await.unwrap();
    assert_eq!(after, workloads_before, "a refused enrollment created a workload");
    plane.enroll(&good).await.expect("the CSR failure did not consume the single use");
}

#[tokio::test]
async fn deny_listed_identity_refused() {
    let plane = Plane::start(GatewayConfig::default()).await;
    let token = plane.mint(&["app=web"], None).await;
    let (id, cert, key) = plane.enroll(&token).await.unwrap();
    let (_, _, mut inbound, _tx) = open_sync(plane.mutual(&cert, &key).await.unwrap()).await.unwrap();

    innerwall_control_plane::foresight::commit(
        &plane.db.pool,
        "test",
        "workload.deny",
        &id.to_string(),
        async |c| {
            authoring::deny(c, id).await?;
            Ok(((), serde_json::json!({})))
        },
    )
    .await
    .unwrap();

    // The live stream is told to enroll again and cut …
    let told =
        tokio::time::timeout(Duration::from_secs(10), inbound.message()).await.expect("stream not cut");
    assert!(
        matches!(&told, Ok(Some(proto::SyncResponse { msg: Some(sync_response::Msg::Directive(proto::Directive {
            directive: Some(proto::directive::Directive::Reenroll(r)) })) })) if r.reason.contains("deny-listed")),
        "{told:?}"
    );
    let end = tokio::time::timeout(Duration::from_secs(10), inbound.message()).await.expect("stream not cut");
    assert!(matches!(end, Ok(None) | Err(_)), "{end:?}");
    // … and a new connection with the same certificate is refused at the handshake.
    let refused = match plane.mutual(&cert, &key).await {
        Err(_) => true,
        Ok(channel) => open_sync(channel).await.is_err(),
    };
    assert!(refused, "a deny-listed identity reconnected");
    // Renewal is refused too.
    let (_, csr) = key_and_csr();
    let renewal = match plane.mutual(&cert, &key).await {
        Err(_) => Err(()),
        Ok(channel) => proto::agent_service_client::AgentServiceClient::new(channel)
            .renew_credential(proto::RenewCredentialRequest { csr_pem: csr })
            .await
            .map(drop)
            .map_err(drop),
    };
    assert!(renewal.is_err());
    let state: i16 = sqlx::query_scalar("SELECT sync_state FROM workloads WHERE id = $1")
        .bind(id.uuid())
        .fetch_one(&plane.db.pool)
        .await
        .unwrap();
    assert_eq!(state, 4, "a cut stream is OFFLINE");
}

/// A Docker or Kubernetes node: hundreds of link-local veth addresses and one routable address.
/// Only the routable one counts against the cap, and only it is registered.
#[tokio::test]
async fn busy_node_enrolls() {
    let plane = Plane::start(GatewayConfig::default()).await;
    let token = plane.mint(&["app=web"], None).await;
    let veths: Vec<String> = (0..300).map(|n| format!("fe80::{n:x}/64")).collect();
    let mut reported: Vec<&str> = veths.iter().map(String::as_str).collect();
    reported.push("10.1.0.5/24");
    let (id, _, _) = plane.enroll_reporting(&token, &reported).await.expect("the busy node enrolls");
    let stored: Vec<String> =
        sqlx::query_scalar("SELECT host(address) FROM workload_addresses WHERE workload_id = $1")
            .bind(id.uuid())
            .fetch_all(&plane.db.pool)
            .await
            .unwrap();
    assert_eq!(stored, ["10.1.0.5"]);

    // More routable addresses than the cap is still refused, naming the cap.
    let many: Vec<String> = (0..=256).map(|n| format!("10.2.{}.{}/16", n / 250, n % 250 + 1)).collect();
    let many: Vec<&str> = many.iter().map(String::as_str).collect();
    let err = plane.enroll_reporting(&token, &many).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("more than 256 routable addresses"), "{err:?}");
}

/// Uploads arrive on their own connection (SYNC-10), which the Sync stream's cut does not end:
/// a retire or deny must end every connection of the workload and refuse every later call.
#[tokio::test]
async fn retired_and_denied_cannot_upload() {
    let plane = Plane::start(GatewayConfig::default()).await;
    let running = plane.running.as_ref().unwrap();
    let now = chrono::Utc::now().timestamp_millis();
    // Each window one millisecond after the last: a workload's windows do not overlap.
    let next = std::sync::atomic::AtomicI64::new(now - 60_000);
    let window = || {
        let start = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        proto::FlowWindow {
            staged_set: String::new(),
            window_id: uuid::Uuid::new_v4().to_string(),
            start_unix_ms: start,
            end_unix_ms: start + 1,
            policy_version: 1,
            mode: proto::EnforcementMode::Visibility.into(),
            records: vec![],
            gaps: vec![],
        }
    };
    let windows = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM flow_windows")
            .fetch_one(&plane.db.pool)
            .await
            .unwrap()
    };
    for (action, want) in
        [("workload.retire", "retired; enroll the host again"), ("workload.deny", "deny-listed")]
    {
        let token = plane.mint(&["app=web"], None).await;
        let (id, cert, key) = plane.enroll(&token).await.unwrap();
        // The version its windows claim, as if its agent had acked it.
        let since = chrono::Utc::now() - chrono::Duration::hours(1);
        innerwall_control_plane::testing::installed(&plane.db.pool, id, &[(1, Mode::Visibility, since)])
            .await
            .unwrap();
        let mut uploads = proto::telemetry_service_client::TelemetryServiceClient::new(
            plane.mutual(&cert, &key).await.unwrap(),
        );
        let before = windows().await;
        uploads.report_flows(proto::ReportFlowsRequest { window: Some(window()) }).await.unwrap();
        assert_eq!(windows().await, before + 1);
        assert_eq!(running.admission.open_connections(id), 1, "the upload connection is registered");

        innerwall_control_plane::foresight::commit(
            &plane.db.pool,
            "test",
            action,
            &id.to_string(),
            async |c| {
                if action == "workload.retire" {
                    authoring::retire(c, id).await?
                } else {
                    authoring::deny(c, id).await?
                }
                Ok(((), serde_json::json!({})))
            },
        )
        .await
        .unwrap();

        // Uploads on the connection opened before the change are refused, saying why, once the
        // replica hears of it (the bridge's notice) …
        let mut refused = None;
        for _ in 0..250 {
            match uploads.report_flows(proto::ReportFlowsRequest { window: Some(window()) }).await {
                Ok(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                Err(err) => {
                    refused = Some(err);
                    break;
                }
            }
        }
        let err = refused.unwrap_or_else(|| panic!("{action}: uploads were still accepted after 5 s"));
        assert_eq!(err.code(), tonic::Code::PermissionDenied, "{action}: {err:?}");
        assert!(err.message().contains(want), "{action}: {err:?}");
        let stored = windows().await;
        // … and that connection ends.
        let ended = format!("{action}: the upload connection ended");
        eventually(&ended, async || running.admission.open_connections(id) == 0).await;
        // Through a new connection nothing is stored either.
        let mut again = proto::telemetry_service_client::TelemetryServiceClient::new(
            plane.mutual(&cert, &key).await.unwrap(),
        );
        assert!(again.report_flows(proto::ReportFlowsRequest { window: Some(window()) }).await.is_err());
        assert_eq!(windows().await, stored, "{action}: nothing more is stored");
    }
}

/// A TLS connection without a client certificate from `source` (a loopback address of its own,
/// so the per-source bound is the attacker's alone), or the error that ended its handshake.
async fn anonymous_tls(
    plane: &Plane,
    source: std::net::IpAddr,
) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::pem::PemObject::pem_slice_iter(plane.ca_pem().as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let mut config =
        rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(std::net::SocketAddr::new(source, 0))?;
    let tcp = socket.connect(plane.running.as_ref().unwrap().local_addr).await?;
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, tcp).await
}

/// A client that proved nothing is bounded: connections from one source beyond the bound are
/// closed at accept, the ones admitted end after the unauthenticated lifetime, an oversized
/// enrollment message is refused by its declared length, and an enrolled agent keeps its
/// stream and its updates throughout.
#[tokio::test]
async fn unauthenticated_clients_are_bounded() {
    use tokio::io::AsyncReadExt;

    let mut plane = Plane::start(GatewayConfig::default()).await;
    plane.limits = Limits {
        max_connections_per_source: 8,
        unauthenticated_lifetime: Duration::from_secs(2),
        ..Limits::default()
    };
    plane.restart(GatewayConfig::default()).await;
    let token = plane.mint(&["app=web"], None).await;
    let (id, cert, key) = plane.enroll(&token).await.unwrap();
    let (_, snapshot, mut inbound, _tx) = open_sync(plane.mutual(&cert, &key).await.unwrap()).await.unwrap();
    let admission = plane.running.as_ref().unwrap().admission.clone();

    // 30 idle connections from one source: 8 are admitted, the rest closed before TLS.
    let attacker: std::net::IpAddr = "127.0.0.2".parse().unwrap();
    let mut held = Vec::new();
    let mut closed = 0;
    for _ in 0..30 {
        match anonymous_tls(&plane, attacker).await {
            Ok(tls) => held.push(tls),
            Err(_) => closed += 1,
        }
    }
    assert_eq!((held.len(), closed), (8, 22));
    assert_eq!(admission.connections(Some(attacker)), 8);

    // An enrollment message larger than the cap is refused by its declared length.
    let mut request = proto::EnrollRequest { provisioning_token: token.clone(), ..Default::default() };
    request.csr_pem = vec![b'x'; 1 << 20];
    let err = proto::enrollment_service_client::EnrollmentServiceClient::new(plane.anonymous().await)
        .enroll(request)
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::OutOfRange, "{err:?}");
    assert!(err.message().contains("too large"), "{err:?}");

    // The idle connections end after their lifetime: the server closes each of them.
    for mut tls in held {
        let mut buf = [0u8; 64];
        let ended = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                match tls.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => continue, // the server's SETTINGS and the like
                }
            }
        })
        .await;
        assert!(ended.is_ok(), "an unauthenticated connection outlived its lifetime");
    }
    eventually("the attacker holds no connection", async || admission.connections(Some(attacker)) == 0).await;

    // The agent's stream outlived all of it and still carries updates.
    innerwall_control_plane::testing::add_web_port(&plane.db.pool, 0).await.unwrap();
    let update = tokio::time::timeout(Duration::from_secs(10), inbound.message()).await.unwrap().unwrap();
    match update.and_then(|r| r.msg) {
        Some(sync_response::Msg::Delta(d)) => {
            assert_eq!((d.from_version, d.to_version), (snapshot.version, snapshot.version + 1))
        }
        other => panic!("expected a delta, got {other:?}"),
    }
    assert_eq!(admission.open_connections(id), 1);
}

/// The certificate the listener presents on a new connection (DER).
async fn presented(plane: &Plane) -> Vec<u8> {
    let tls = anonymous_tls(plane, "127.0.0.1".parse().unwrap()).await.unwrap();
    tls.get_ref().1.peer_certificates().unwrap()[0].as_ref().to_vec()
}

/// The listener's certificate is reissued from the CA at half its lifetime and presented from
/// the next handshake on: after the first one expired, hosts still enroll and agents still
/// connect, and a stream opened under the first one carries on, all without a restart.
#[tokio::test]
async fn server_certificate_renews_without_restart() {
    let mut plane = Plane::start(GatewayConfig::default()).await;
    plane.server_cert_lifetime = Duration::from_secs(4);
    plane.restart(GatewayConfig::default()).await;
    let first = presented(&plane).await;
    let first_expiry = innerwall_control_plane::identity::ca::certificate_not_after(&first).unwrap();
    let token = plane.mint(&["app=web"], None).await;
    let (_, cert, key) = plane.enroll(&token).await.unwrap();
    let (_, snapshot, mut inbound, _tx) = open_sync(plane.mutual(&cert, &key).await.unwrap()).await.unwrap();

    // The expiry of the first certificate, observed on the wall clock it is judged by.
    while SystemTime::now() <= first_expiry + Duration::from_secs(1) {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let now = presented(&plane).await;
    assert_ne!(now, first, "still presenting the first certificate");
    let now_expiry = innerwall_control_plane::identity::ca::certificate_not_after(&now).unwrap();
    assert!(now_expiry > SystemTime::now(), "the presented certificate is expired");
    // Full handshakes that verify the server certificate: enrollment and a new agent stream.
    let (_, cert2, key2) = plane.enroll(&token).await.unwrap();
    open_sync(plane.mutual(&cert2, &key2).await.unwrap()).await.unwrap();
    // The stream opened under the first certificate still carries updates.
    innerwall_control_plane::testing::add_web_port(&plane.db.pool, 0).await.unwrap();
    let update = tokio::time::timeout(Duration::from_secs(10), inbound.message()).await.unwrap().unwrap();
    match update.and_then(|r| r.msg) {
        Some(sync_response::Msg::Delta(d)) => assert_eq!(d.from_version, snapshot.version),
        other => panic!("expected a delta, got {other:?}"),
    }
}

/// An enrolled app=db workload that admits every app=web workload: its peer set shows which
/// web workloads are rendered.
async fn db_admitting_web(plane: &Plane) -> WorkloadId {
    let db_token = plane.mint(&["app=db"], None).await;
    let (db, _, _) = plane.enroll_reporting(&db_token, &["10.1.0.4/24"]).await.unwrap();
    crate::addresses::db_admits_web(&plane.db.pool).await;
    db
}

/// Enrollments written together, as concurrent ones are: each in a savepoint of its own, so a
/// refused one writes nothing (its token use included) and the others commit; one render gives
/// the enrolled workloads version 1, audited once with every version it moved and the
/// enrollments it rendered. A second batch on the same estate does it again.
#[tokio::test]
async fn enrollments_written_together_render_once_and_fail_alone() {
    use innerwall_control_plane::identity::enroll::{Checked, Enroller};

    let plane = Plane::start(GatewayConfig::default()).await;
    let pool = &plane.db.pool;
    let db = db_admitting_web(&plane).await;
    let enroller = Enroller::new(pool.clone(), plane.signer.clone(), plane.cert_lifetime);
    let checked =
        |token: &str, address: &str| Checked::new(&enroll_request(token, &[address], false).1, None).unwrap();
    let renders = async || -> Vec<(serde_json::Value, serde_json::Value)> {
        sqlx::query_as(
            "SELECT detail->'enrollments', workload_versions FROM audit_log
             WHERE actor = 'enroll' AND action = 'policy.render' ORDER BY id",
        )
        .fetch_all(pool)
        .await
        .unwrap()
    };
    let versions = async |id: WorkloadId| -> Vec<i64> {
        sqlx::query_scalar(
            "SELECT version FROM workload_policy_history WHERE workload_id = $1 ORDER BY version",
        )
        .bind(id.uuid())
        .fetch_all(pool)
        .await
        .unwrap()
    };
    let peers = async || crate::addresses::peers(pool, db).await.0;
    let before = renders().await.len();

    for round in 0..2u8 {
        let token = plane.mint(&["app=web"], Some(2)).await;
        let address = |host: u8| format!("10.1.{}.{host}/24", 1 + round);
        // A bad CSR is refused where the request arrives, before it can join a batch.
        let bad_csr = proto::EnrollRequest {
            csr_pem: b"not a csr".to_vec(),
            ..enroll_request(&token, &[&address(6)], false).1
        };
        let refused = Checked::new(&bad_csr, None).unwrap_err().to_string();
        assert!(refused.contains("csr"), "round {round}: {refused}");
        // Replacing a workload that does not exist fails in the batch, in its savepoint.
        let replacing_nothing =
            Checked::new(&enroll_request(&token, &[&address(6)], false).1, Some(WorkloadId::new_random()))
                .unwrap();
        let batch = vec![
            checked(&token, &address(5)),
            replacing_nothing,
            checked("iw_0000000_notatoken", &address(7)),
            checked(&token, &address(8)),
            checked(&token, &address(9)),
            checked("iw_0000000_notatoken", &address(10)),
        ];
        let results = enroller.enroll_together(batch).await;
        let outcome: Vec<Result<(), String>> =
            results.iter().map(|r| r.as_ref().map(|_| ()).map_err(ToString::to_string)).collect();
        assert!(outcome[0].is_ok() && outcome[3].is_ok(), "round {round}: {outcome:?}");
        assert!(outcome[1].as_ref().is_err_and(|e| e.contains("not found")), "round {round}: {outcome:?}");
        assert!(outcome[2].is_err(), "round {round}: an unknown token: {outcome:?}");
        // A token is looked up once per batch; each enrollment that presented it hears why.
        assert_eq!(outcome[5], outcome[2], "round {round}");
        assert!(
            matches!(
                &results[5],
                Err(innerwall_control_plane::error::Error::Token { kind: "malformed" | "unknown", .. })
            ),
            "round {round}: {outcome:?}"
        );
        // The token had two uses: the failed replacement took none, so the fourth enrollment
        // had one, and the fifth found none.
        assert!(
            outcome[4].as_ref().is_err_and(|e| e.contains("is used up (2 of 2 uses)")),
            "round {round}: {outcome:?}"
        );
        let uses: i64 =
            sqlx::query_scalar("SELECT sum(use_count) FROM provisioning_tokens WHERE max_uses = 2")
                .fetch_one(pool)
                .await
                .unwrap();
        assert_eq!(uses, 2 * (1 + i64::from(round)), "round {round}: the two that enrolled took a use each");
        let (a, b) = (results[0].as_ref().unwrap().id, results[3].as_ref().unwrap().id);
        assert_eq!((versions(a).await, versions(b).await), (vec![1], vec![1]), "round {round}");
        let workloads: i64 =
            sqlx::query_scalar("SELECT count(*) FROM workloads").fetch_one(pool).await.unwrap();
        assert_eq!(
            workloads,
            3 + 2 * i64::from(round),
            "round {round}: only the enrollments that succeeded wrote a workload"
        );
        let enrolled: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM audit_log WHERE action = 'workload.enroll' AND subject IN ($1, $2)",
        )
        .bind(a.to_string())
        .bind(b.to_string())
        .fetch_one(pool)
        .await
        .unwrap();
        assert_eq!(enrolled, 2, "round {round}");
        let renders = renders().await;
        assert_eq!(renders.len(), before + 1 + usize::from(round), "round {round}: one render for the batch");
        let (enrollments, moved) = renders.last().unwrap();
        assert_eq!(enrollments, &serde_json::json!([a.to_string(), b.to_string()]), "round {round}");
        assert_eq!((moved[a.to_string()].as_u64(), moved[b.to_string()].as_u64()), (Some(1), Some(1)));
        assert!(moved[db.to_string()].as_u64().is_some(), "round {round}: db's peers moved: {moved}");
        let mut want = vec!["10.1.1.5/32".to_owned(), "10.1.1.8/32".to_owned()];
        if round == 1 {
            want.extend(["10.1.2.5/32".to_owned(), "10.1.2.8/32".to_owned()]);
        }
        assert_eq!(peers().await, want, "round {round}");
    }
}

/// A batch that fails as a whole (here the database refuses its render's audit record because
/// it names more than one enrollment) is written again one enrollment at a time: every
/// enrollment still succeeds, each with a render of its own.
#[tokio::test]
async fn a_batch_that_fails_whole_is_written_one_enrollment_at_a_time() {
    use innerwall_control_plane::identity::enroll::{Checked, Enroller};

    let plane = Plane::start(GatewayConfig::default()).await;
    let pool = &plane.db.pool;
    sqlx::query(
        "ALTER TABLE audit_log ADD CONSTRAINT test_one_enrollment_per_render
         CHECK (jsonb_array_length(COALESCE(detail->'enrollments', '[]'::jsonb)) < 2)",
    )
    .execute(pool)
    .await
    .unwrap();
    let enroller = Enroller::new(pool.clone(), plane.signer.clone(), plane.cert_lifetime);
    let token = plane.mint(&["app=web"], None).await;
    let batch = ["10.1.0.5/24", "10.1.0.6/24", "10.1.0.7/24"]
        .map(|a| Checked::new(&enroll_request(&token, &[a], false).1, None).unwrap());
    let results = enroller.enroll_together(batch.into()).await;
    let ids: Vec<String> = results.iter().map(|r| r.as_ref().unwrap().id.to_string()).collect();
    let renders: Vec<serde_json::Value> = sqlx::query_scalar(
        "SELECT detail->'enrollments' FROM audit_log WHERE actor = 'enroll' AND action = 'policy.render' ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(renders, ids.iter().map(|id| serde_json::json!([id])).collect::<Vec<_>>());
    let workloads: i64 = sqlx::query_scalar("SELECT count(*) FROM workloads").fetch_one(pool).await.unwrap();
    assert_eq!(workloads, 3);
}

/// Issue 16 item 3: re-enrolling a host (`innerwall-agent enroll --force`) replaces its
/// workload. The old credential, presented as the enrollment connection's client certificate,
/// proves the host held that identity; the control plane retires the old workload in the
/// enrollment's transaction, audited naming both, and it leaves every render (so the new
/// workload's claim on the same address is its alone: a live claim by both would render the
/// address for neither). A certificate without `replace` retires nothing (`--keep-replaced`),
/// a certificate can replace only its own workload, and `replace` without one is refused.
#[tokio::test]
async fn enroll_force_retires_the_workload_it_replaces() {
    let plane = Plane::start(GatewayConfig::default()).await;
    let pool = &plane.db.pool;
    let db = db_admitting_web(&plane).await;
    let peers = async || crate::addresses::peers(pool, db).await.0;
    let live = async |id: WorkloadId| -> bool {
        sqlx::query_scalar("SELECT retired_at IS NULL FROM workloads WHERE id = $1")
            .bind(id.uuid())
            .fetch_one(pool)
            .await
            .unwrap()
    };

    let token = plane.mint(&["app=web"], None).await;
    let a = plane.enroll_replacing(&token, &["10.1.0.5/24"], None, false).await.unwrap();
    let b = plane.enroll_replacing(&token, &["10.1.0.6/24"], None, false).await.unwrap();
    assert!(a.replaced.is_empty());
    assert_eq!(peers().await, ["10.1.0.5/32", "10.1.0.6/32"]);

    // Host a enrolls again, proving it held a: a is retired, the new workload takes its place.
    let a2 = plane.enroll_replacing(&token, &["10.1.0.5/24"], Some((&a.cert, &a.key)), true).await.unwrap();
    assert_eq!(a2.replaced, a.id.to_uri());
    assert_eq!((live(a.id).await, live(a2.id).await, live(b.id).await), (false, true, true));
    assert_eq!(peers().await, ["10.1.0.5/32", "10.1.0.6/32"], "a left the render, a2 holds its address");
    // Audited in the enrollment's transaction, each record naming the other workload.
    let audit: Vec<(String, String, String, serde_json::Value)> = sqlx::query_as(
        "SELECT actor, action, subject, detail FROM audit_log
         WHERE subject IN ($1, $2) AND action IN ('workload.enroll', 'workload.retire') ORDER BY id",
    )
    .bind(a.id.to_string())
    .bind(a2.id.to_string())
    .fetch_all(pool)
    .await
    .unwrap();
    let summary: Vec<(&str, String, serde_json::Value)> = audit
        .iter()
        .map(|(_, action, subject, detail)| {
            let other = detail.get("replaced_by").or_else(|| detail.get("replaces")).cloned();
            (action.as_str(), subject.clone(), other.unwrap_or_default())
        })
        .collect();
    assert_eq!(
        summary,
        [
            ("workload.enroll", a.id.to_string(), serde_json::Value::Null),
            ("workload.retire", a.id.to_string(), serde_json::json!(a2.id.to_string())),
            ("workload.enroll", a2.id.to_string(), serde_json::json!(a.id.to_string())),
        ]
    );
    assert!(audit[1].0.starts_with("enroll:iw_"), "the enrollment is the actor: {:?}", audit[1].0);

    // A certificate without `replace` (`--keep-replaced`) retires nothing.
    let b2 = plane.enroll_replacing(&token, &["10.1.0.7/24"], Some((&b.cert, &b.key)), false).await.unwrap();
    assert!(b2.replaced.is_empty());
    assert_eq!((live(b.id).await, live(b2.id).await), (true, true));

    // A certificate replaces only its own workload: b's retires b, and a2 stays live.
    let b3 = plane.enroll_replacing(&token, &["10.1.0.6/24"], Some((&b.cert, &b.key)), true).await.unwrap();
    assert_eq!(b3.replaced, b.id.to_uri());
    assert_eq!(
        (live(b.id).await, live(a2.id).await, live(b2.id).await, live(b3.id).await),
        (false, true, true, true)
    );
    assert_eq!(peers().await, ["10.1.0.5/32", "10.1.0.6/32", "10.1.0.7/32"]);

    // `replace` with no certificate to prove anything is refused and writes nothing.
    let count = async || -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM workloads").fetch_one(pool).await.unwrap()
    };
    let before = count().await;
    let err = plane.enroll_replacing(&token, &["10.1.0.8/24"], None, true).await.err().unwrap();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("client certificate"), "{err:?}");
    assert_eq!(count().await, before);
}
