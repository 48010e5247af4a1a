//! Console sign-in (issue 29, OPS-4): an operator token is exchanged for a session cookie
//! (`HttpOnly; Secure; SameSite=Strict`, [`LIFETIME`]) whose secret is kept only as its SHA-256
//! (migration 0032). A session is as good as its token: every request re-reads the token's row,
//! so a revoked or expired token ends its sessions at once. Every form of a session carries the
//! session's CSRF secret back, and every write checks it ([`Session::check_csrf`]).

use axum::http::HeaderMap;
use axum::http::header::COOKIE;
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use chrono::{DateTime, Utc};
use ring::rand::{SecureRandom, SystemRandom};
use sqlx::{PgPool, Row};

use crate::audit;
use crate::error::Error;
use crate::identity::operators::{self, Operator, Refused};

/// The session cookie's name.
pub const COOKIE_NAME: &str = "iw_session";
/// How long a session lives after sign-in; then the operator signs in again.
pub const LIFETIME: chrono::TimeDelta = chrono::TimeDelta::hours(1);
/// The most live sessions one token holds; a sign-in past it ends the oldest.
pub const MAX_SESSIONS_PER_TOKEN: i64 = 16;
/// The longest `Cookie` header read.
const MAX_COOKIE_HEADER: usize = 4_096;

/// A signed-in operator and the secret the session's forms carry.
#[derive(Debug, Clone)]
pub struct Session {
    pub operator: Operator,
    pub csrf: String,
    pub expires_at: DateTime<Utc>,
}

impl Session {
    /// Whether `given` (a form's `csrf` field) is this session's secret, compared in constant
    /// time.
    pub fn check_csrf(&self, given: &str) -> bool {
        let (ours, theirs) = (self.csrf.as_bytes(), given.as_bytes());
        ours.len() == theirs.len() && ours.iter().zip(theirs).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}

/// 32 random bytes as 43 characters of base64url.
fn secret() -> Result<String, Error> {
    let mut bytes = [0u8; 32];
    SystemRandom::new().fill(&mut bytes).map_err(|_| Error::Corrupt {
        what: "random source",
        detail: "the system's random source failed".into(),
    })?;
    Ok(URL_SAFE_NO_PAD.encode(bytes))
}

fn hash(secret: &str) -> Vec<u8> {
    ring::digest::digest(&ring::digest::SHA256, secret.as_bytes()).as_ref().to_vec()
}

/// Why no session: none presented, or one that is not (or no longer) valid.
#[derive(Debug, thiserror::Error)]
pub enum NoSession {
    #[error("not signed in")]
    Absent,
    #[error("the session ended: sign in again")]
    Ended,
    #[error(transparent)]
    Database(#[from] Error),
}

/// Signs in with an operator token: a new session (and its cookie secret), audited as
/// `console.sign-in`; the token's oldest sessions past [`MAX_SESSIONS_PER_TOKEN`] and every
/// expired session end here.
pub async fn sign_in(pool: &PgPool, token: &str) -> Result<(String, Session), Refused> {
    let operator = operators::authenticate(pool, token).await?;
    let (cookie, csrf) = (secret()?, secret()?);
    let mut tx = pool.begin().await.map_err(Error::from)?;
    sqlx::query("DELETE FROM console_sessions WHERE expires_at <= now()")
        .execute(&mut *tx)
        .await
        .map_err(Error::from)?;
    sqlx::query(
        "DELETE FROM console_sessions WHERE secret_hash IN (SELECT secret_hash FROM console_sessions
          WHERE token_id = $1 ORDER BY created_at DESC OFFSET $2)",
    )
    .bind(&operator.token_id)
    .bind(MAX_SESSIONS_PER_TOKEN - 1)
    .execute(&mut *tx)
    .await
    .map_err(Error::from)?;
    let expires_at: DateTime<Utc> = sqlx::query_scalar(
        "INSERT INTO console_sessions (secret_hash, token_id, csrf, expires_at)
         VALUES ($1, $2, $3, now() + $4) RETURNING expires_at",
    )
    .bind(hash(&cookie))
    .bind(&operator.token_id)
    .bind(&csrf)
    .bind(LIFETIME)
    .fetch_one(&mut *tx)
    .await
    .map_err(Error::from)?;
    let actor = operator.actor();
    let record = audit::Record::new(&actor, "console.sign-in", &operator.token_id)
        .detail(serde_json::json!({"expires_at": expires_at}));
    audit::write(&mut tx, &record).await?;
    tx.commit().await.map_err(Error::from)?;
    Ok((cookie, Session { operator, csrf, expires_at }))
}

/// The session cookie's secret in `headers`, if one is there.
pub fn cookie(headers: &HeaderMap) -> Option<String> {
    for value in headers.get_all(COOKIE) {
        if value.len() > MAX_COOKIE_HEADER {
            return None;
        }
        let Ok(text) = value.to_str() else { continue };
        for pair in text.split(';') {
            if let Some((name, value)) = pair.trim().split_once('=')
                && name == COOKIE_NAME
                && value.len() == 43
            {
                return Some(value.to_owned());
            }
        }
    }
    None
}

/// The live session of the cookie in `headers`: its token still valid (not revoked, not
/// expired) and the session not expired.
pub async fn session(pool: &PgPool, headers: &HeaderMap) -> Result<Session, NoSession> {
    let secret = cookie(headers).ok_or(NoSession::Absent)?;
    let row = sqlx::query(
        "SELECT t.id, t.name, t.role, s.csrf, s.expires_at FROM console_sessions s
           JOIN operator_tokens t ON t.id = s.token_id
          WHERE s.secret_hash = $1 AND s.expires_at > now() AND t.revoked_at IS NULL
            AND (t.expires_at IS NULL OR t.expires_at > now())",
    )
    .bind(hash(&secret))
    .fetch_optional(pool)
    .await
    .map_err(Error::from)?
    .ok_or(NoSession::Ended)?;
    let role: String = row.get(2);
    let role = role.parse().map_err(|_| Error::Corrupt { what: "operator role", detail: role.clone() })?;
    Ok(Session {
        operator: Operator { token_id: row.get(0), name: row.get(1), role },
        csrf: row.get(3),
        expires_at: row.get(4),
    })
}

/// Ends the session of the cookie in `headers` (nothing if there is none).
pub async fn sign_out(pool: &PgPool, headers: &HeaderMap) -> Result<(), Error> {
    if let Some(secret) = cookie(headers) {
        sqlx::query("DELETE FROM console_sessions WHERE secret_hash = $1")
            .bind(hash(&secret))
            .execute(pool)
            .await?;
    }
    Ok(())
}

/// The `Set-Cookie` value of a new session.
pub fn set_cookie(secret: &str) -> String {
    format!(
        "{COOKIE_NAME}={secret}; Path=/; Max-Age={}; HttpOnly; Secure; SameSite=Strict",
        LIFETIME.num_seconds()
    )
}

/// The `Set-Cookie` value that removes the session cookie.
pub fn clear_cookie() -> String {
    format!("{COOKIE_NAME}=; Path=/; Max-Age=0; HttpOnly; Secure; SameSite=Strict")
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    #[test]
    fn the_cookie_is_read_from_any_cookie_header_and_bounded() {
        let secret = "a".repeat(43);
        let with = |values: &[&str]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(COOKIE, HeaderValue::from_str(v).unwrap());
            }
            h
        };
        assert_eq!(cookie(&with(&[&format!("x=1; iw_session={secret}; y=2")])), Some(secret.clone()));
        assert_eq!(cookie(&with(&["x=1", &format!("iw_session={secret}")])), Some(secret.clone()));
        assert_eq!(cookie(&with(&["iw_session=short"])), None);
        assert_eq!(cookie(&with(&[&format!("iw_sessionx={secret}")])), None);
        assert_eq!(cookie(&with(&[])), None);
        let long = format!("{}; iw_session={secret}", "p=q; ".repeat(1_000));
        assert_eq!(cookie(&with(&[&long])), None);
    }

    #[test]
    fn secrets_are_fresh_and_csrf_compares_whole() {
        let (a, b) = (secret().unwrap(), secret().unwrap());
        assert_ne!(a, b);
        assert_eq!(a.len(), 43);
        let session = Session {
            operator: Operator {
                token_id: "abcdefgh".into(),
                name: "vera".into(),
                role: operators::Role::Viewer,
            },
            csrf: a.clone(),
            expires_at: Utc::now(),
        };
        assert!(session.check_csrf(&a));
        assert!(!session.check_csrf(&b));
        assert!(!session.check_csrf(&a[..42]));
        assert!(!session.check_csrf(""));
    }
}
