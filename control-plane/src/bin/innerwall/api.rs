//! `--api`: the operator HTTP API as the CLI's data source. One HTTPS/1.1 request per call,
//! trusting only the `--api-ca` bundle, with a timeout and a response-size bound; a problem
//! document comes back as an error carrying its `detail`, the text the local error prints.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use innerwall_control_plane::identity::operators::OPERATOR_TOKEN_PREFIX;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde::de::DeserializeOwned;

/// The whole exchange (connect, TLS, request, response) must finish within this.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// The largest response body read; list pages are bounded far below this by the API.
const MAX_RESPONSE: usize = 16 << 20;

/// A control plane's API, reached as `--api https://host:port` with an operator token
/// (`--token-file` or `INNERWALL_API_TOKEN`).
pub struct ApiClient {
    host: String,
    port: u16,
    token: String,
    tls: tokio_rustls::TlsConnector,
    /// `--page-size`: rows per page a list command asks for.
    pub page_size: u32,
    /// `--api-ca`, named when the server's certificate is not of it.
    ca: std::path::PathBuf,
}

impl std::fmt::Debug for ApiClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiClient(https://{}:{})", self.host, self.port)
    }
}

impl ApiClient {
    pub fn new(
        api: &str,
        token: Option<&str>,
        ca: Option<&Path>,
        page_size: u32,
    ) -> anyhow::Result<ApiClient> {
        let Some(rest) = api.strip_prefix("https://") else {
            if api.starts_with("http://") {
                bail!(
                    "--api {api:?}: the operator API speaks only HTTPS; write https://HOST:PORT, the address \
                     `serve --api-listen` gives (its log says \"operator API on https://…\")"
                );
            }
            bail!("--api {api:?}: give the control plane's API as https://HOST:PORT (e.g. https://cp:8443)");
        };
        let authority = rest.trim_end_matches('/').trim_end_matches("/api/v1");
        let (host, port) = match authority.rsplit_once(':') {
            Some((host, port)) => {
                (host, port.parse().with_context(|| format!("--api {api:?}: {port:?} is not a port"))?)
            }
            None => (authority, 443),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']').to_owned();
        let Some(token) = token.filter(|t| !t.is_empty()) else {
            bail!(
                "--api needs an operator token: pass --token-file FILE (`-` for standard input) or set \
                 INNERWALL_API_TOKEN (mint one on the host with `innerwall operator token mint`)"
            );
        };
        if !token.starts_with(OPERATOR_TOKEN_PREFIX) && token.starts_with("iw_") {
            bail!(
                "the token given for --api is a provisioning token (iw_…), which enrolls an agent; the API \
                 takes an operator token (iwo_…): mint one on the host with `innerwall operator token mint`"
            );
        }
        let Some(ca) = ca else {
            bail!(
                "--api needs --api-ca FILE: the API's certificate is issued by the control plane's own CA, \
                 which the system roots do not hold; copy <ca-dir>/ca.crt from the host and pass it"
            );
        };
        let pem = std::fs::read(ca).with_context(|| format!("while reading --api-ca {}", ca.display()))?;
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(&pem) {
            roots.add(cert.with_context(|| format!("{} is not a PEM bundle", ca.display()))?)?;
        }
        if roots.is_empty() {
            bail!("--api-ca {}: no certificate in it; pass the CA bundle in PEM", ca.display());
        }
        let mut config =
            rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()?
                .with_root_certificates(roots)
                .with_no_client_auth();
        // Offered so that a server of another protocol (the agent listener speaks only h2)
        // refuses in the handshake, where the refusal can be named.
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let tls = tokio_rustls::TlsConnector::from(Arc::new(config));
        Ok(ApiClient { host, port, token: token.to_owned(), tls, page_size, ca: ca.to_owned() })
    }

    pub async fn get<T: DeserializeOwned>(&self, path: &str) -> anyhow::Result<T> {
        self.call("GET", path, None, None).await
    }

    /// A write: `body` as JSON, `version` as `If-Match`.
    pub async fn write<T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        version: Option<i64>,
        body: Option<&serde_json::Value>,
    ) -> anyhow::Result<T> {
        self.call(method, path, version, body).await
    }

    async fn call<T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        version: Option<i64>,
        body: Option<&serde_json::Value>,
    ) -> anyhow::Result<T> {
        let url = format!("https://{}:{}{path}", self.host, self.port);
        let (status, bytes) = tokio::time::timeout(REQUEST_TIMEOUT, self.send(method, path, version, body))
            .await
            .with_context(|| format!("{method} {url}: no answer within {REQUEST_TIMEOUT:?}"))?
            .with_context(|| format!("while calling {method} {url}"))?;
        if !(200..300).contains(&status) {
            let problem: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
            match problem["detail"].as_str() {
                Some(detail) => bail!("{detail}"),
                None => bail!("{method} {url}: HTTP {status}: {}", String::from_utf8_lossy(&bytes)),
            }
        }
        serde_json::from_slice(&bytes)
            .with_context(|| format!("{method} {url}: the answer is not what this CLI understands"))
    }

    async fn send(
        &self,
        method: &str,
        path: &str,
        version: Option<i64>,
        body: Option<&serde_json::Value>,
    ) -> anyhow::Result<(u16, Bytes)> {
        let tcp = tokio::net::TcpStream::connect((self.host.as_str(), self.port)).await.map_err(|e| {
            anyhow::anyhow!(
                "cannot connect to {}:{} ({e}): is `innerwall serve --api-listen` running there, on that port?",
                self.host,
                self.port
            )
        })?;
        let name = ServerName::try_from(self.host.clone())?;
        let first = Arc::new(std::sync::Mutex::new(Vec::new()));
        let sniffed = Sniff { inner: tcp, first: first.clone() };
        let stream = match self.tls.connect(name, sniffed).await {
            Ok(stream) => stream,
            Err(e) => {
                let first = first.lock().map(|b| b.clone()).unwrap_or_default();
                return Err(self.handshake_failed(&e, &first));
            }
        };
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(connection);
        let mut request = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", format!("{}:{}", self.host, self.port))
            .header("authorization", format!("Bearer {}", self.token))
            .header("accept", "application/json");
        if let Some(version) = version {
            request = request.header("if-match", format!("\"{version}\""));
        }
        let body = match body {
            Some(value) => {
                request = request.header("content-type", "application/json");
                Bytes::from(serde_json::to_vec(value)?)
            }
            None => Bytes::new(),
        };
        let response = sender.send_request(request.body(Full::new(body))?).await?;
        let status = response.status().as_u16();
        let bytes = Limited::new(response.into_body(), MAX_RESPONSE)
            .collect()
            .await
            .map_err(|e| anyhow::anyhow!("reading the answer: {e} (limit {MAX_RESPONSE} bytes)"))?
            .to_bytes();
        Ok((status, bytes))
    }
}

impl ApiClient {
    /// What a failed TLS handshake says about where `--api` points, and what to do instead.
    fn handshake_failed(&self, e: &std::io::Error, first: &[u8]) -> anyhow::Error {
        use rustls::{AlertDescription, CertificateError};
        let url = format!("https://{}:{}", self.host, self.port);
        let listen = "point --api at the address `innerwall serve --api-listen` gives (its log says \
                      \"operator API on https://…\")";
        if first.starts_with(b"HTTP/") {
            return anyhow::anyhow!(
                "{url} answered in plain HTTP, not TLS: it is not the operator API, which is HTTPS only \
                 (is it the metrics listener, `--metrics-listen`?); {listen}"
            );
        }
        let tls = e.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>());
        let ca = self.ca.display();
        match tls {
            Some(rustls::Error::AlertReceived(AlertDescription::NoApplicationProtocol)) => anyhow::anyhow!(
                "{url} speaks only HTTP/2 (gRPC), not the operator API's HTTP/1.1: it is the agent listener \
                 (`serve --listen`, port 7443 by default), where agents connect; {listen}"
            ),
            Some(rustls::Error::InvalidCertificate(
                CertificateError::UnknownIssuer | CertificateError::BadSignature,
            )) => anyhow::anyhow!(
                "the certificate of {url} is not issued by the CA in --api-ca {ca}: pass that control \
                 plane's own CA bundle (its <ca-dir>/ca.crt, or the CA of its --api-cert)"
            ),
            Some(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => anyhow::anyhow!(
                "the certificate of {url} is not for the name {:?}: call the API by a name its \
                 certificate holds (`serve --server-name`, or the names of its --api-cert)",
                self.host
            ),
            Some(rustls::Error::InvalidCertificate(why)) => anyhow::anyhow!(
                "the certificate of {url} is not accepted ({why:?}); check --api-ca {ca} and the server's certificate"
            ),
            _ => anyhow::anyhow!(
                "the TLS handshake with {url} failed ({e}): is it the operator API? {listen}, with \
                 --api-ca its CA bundle"
            ),
        }
    }
}

/// A connection that keeps the first bytes it reads, so a failed TLS handshake can tell a plain
/// HTTP server (`HTTP/1.1 400 …` in answer to the ClientHello) from other failures.
struct Sniff {
    inner: tokio::net::TcpStream,
    first: Arc<std::sync::Mutex<Vec<u8>>>,
}

/// How many of the first bytes read [`Sniff`] keeps.
const SNIFFED: usize = 16;

impl tokio::io::AsyncRead for Sniff {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Ok(mut first) = self.first.lock()
            && first.len() < SNIFFED
        {
            let new = &buf.filled()[before..];
            let take = new.len().min(SNIFFED - first.len());
            first.extend_from_slice(&new[..take]);
        }
        polled
    }
}

impl tokio::io::AsyncWrite for Sniff {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Percent-encodes a path segment (names are operator-chosen).
pub fn segment(name: &str) -> String {
    let mut out = String::new();
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `path?name=value&…`, each value percent-encoded (the caller leaves out what it does not send).
pub fn with_query(path: &str, pairs: &[(&str, String)]) -> String {
    let query: Vec<String> = pairs.iter().map(|(name, value)| format!("{name}={}", segment(value))).collect();
    if query.is_empty() { path.to_owned() } else { format!("{path}?{}", query.join("&")) }
}
