//! Addressing a cluster: connection URLs (TCP and unix socket), ports, redaction for messages and
//! SQL identifier quoting. Pure string functions, except [`pick_free_port`].

use std::path::Path;

use super::{Error, io_error};

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
/// needs no password (see [`Cluster::init`](super::Cluster::init)). The port names the socket file.
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
    fn identifiers_are_quoted() {
        assert_eq!(quote_ident("iw_test"), "\"iw_test\"");
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
    }
}
