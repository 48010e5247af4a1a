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
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde::de::DeserializeOwned;

/// The whole exchange (connect, TLS, request, response) must finish within this.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// The largest response body read; list pages are bounded far below this by the API.
const MAX_RESPONSE: usize = 16 << 20;

/// A control plane's API, reached as `--api https://host:port` with `--token`.
pub struct ApiClient {
    host: String,
    port: u16,
    token: String,
    tls: tokio_rustls::TlsConnector,
    /// `--page-size`: rows per page a list command asks for.
    pub page_size: u32,
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
                "--api needs an operator token: pass --token or set INNERWALL_TOKEN (mint one on the host with `innerwall operator token mint`)"
            );
        };
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
        let config =
            rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()?
                .with_root_certificates(roots)
                .with_no_client_auth();
        let tls = tokio_rustls::TlsConnector::from(Arc::new(config));
        Ok(ApiClient { host, port, token: token.to_owned(), tls, page_size })
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
        let tcp = tokio::net::TcpStream::connect((self.host.as_str(), self.port)).await?;
        let name = ServerName::try_from(self.host.clone())?;
        let stream = self.tls.connect(name, tcp).await?;
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
