//! Operator tokens (issue 12, OPS-2): the bearer credentials of the operator HTTP API, with a
//! role each. Minted, listed and revoked on a control-plane host (`innerwall operator token`);
//! checked on every API request by [`authenticate`].
//!
//! A token is `iwo_` + an id of 8 characters (48 random bits, not secret: the lookup key, listed
//! and named in audit records) + a secret of 43 characters (256 random bits), all base64url
//! without padding. Only the SHA-256 of the whole text is stored: a fast hash is enough for a
//! secret of that entropy, which no one can guess however fast they hash. The presented hash is
//! compared with the stored one in constant time, and an unknown id is compared against a dummy,
//! so neither timing nor the answer says whether an id exists: a token whose secret does not
//! match is "not valid" whatever its id, and only the holder of the secret learns that it
//! expired or was revoked.

use std::fmt;
use std::str::FromStr;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use chrono::{DateTime, Utc};
use ring::digest::{SHA256, digest};
use ring::rand::{SecureRandom, SystemRandom};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool, Row};

use crate::audit;
use crate::error::Error;

/// Every operator token starts with this, so secret scanners can spot a leaked one.
pub const OPERATOR_TOKEN_PREFIX: &str = "iwo_";
const ID_BYTES: usize = 6;
/// base64url of [`ID_BYTES`].
pub const ID_LEN: usize = 8;
const SECRET_BYTES: usize = 32;
/// base64url without padding of [`SECRET_BYTES`].
const SECRET_LEN: usize = 43;
/// The whole token's length.
pub const TOKEN_LEN: usize = OPERATOR_TOKEN_PREFIX.len() + ID_LEN + SECRET_LEN;
/// The longest expiry a token may be minted with.
pub const MAX_EXPIRY_DAYS: i64 = 3 * 365;
/// How long a token minted without an explicit expiry is valid.
pub const DEFAULT_EXPIRY_DAYS: i64 = 90;
/// Names: 1–63 characters of `A-Z a-z 0-9 . _ -`, starting and ending alphanumeric, and never
/// of an id's shape ([`ID_LEN`] characters without a `.`), so a name is never read as an id.
pub const MAX_NAME: usize = 63;

/// How long a minted token is valid: by default [`DEFAULT_EXPIRY_DAYS`]; a token that never
/// expires is asked for explicitly (`--expires never`) and listed as such.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expiry {
    After(chrono::Duration),
    Never,
}

impl Default for Expiry {
    fn default() -> Self {
        Expiry::After(chrono::Duration::days(DEFAULT_EXPIRY_DAYS))
    }
}

/// Which token a revocation means: by id, or the live token of a name. Never guessed from one
/// text, so a name can never be taken for another token's id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenRef {
    Id(String),
    Name(String),
}

impl fmt::Display for TokenRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenRef::Id(id) => write!(f, "id {id:?}"),
            TokenRef::Name(name) => write!(f, "name {name:?}"),
        }
    }
}

/// Whether `text` has the shape of a token id: [`ID_LEN`] characters of base64url.
pub fn is_id_shaped(text: &str) -> bool {
    text.len() == ID_LEN && text.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// What a token may do; each role may do everything the roles before it may.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Reads everything.
    Viewer,
    /// Also authors: services, address groups, rulesets, labels, provisioning tokens.
    Editor,
    /// Also changes modes and promotes.
    Promoter,
    /// Also retires and deny-lists workloads.
    Admin,
}

impl Role {
    pub const ALL: [Role; 4] = [Role::Viewer, Role::Editor, Role::Promoter, Role::Admin];

    pub fn name(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Editor => "editor",
            Role::Promoter => "promoter",
            Role::Admin => "admin",
        }
    }

    /// Whether a token of this role may do what `needed` may.
    pub fn allows(self, needed: Role) -> bool {
        self >= needed
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Role {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        Role::ALL.into_iter().find(|r| r.name() == s).ok_or_else(|| {
            Error::Invalid(format!("unknown role {s:?}: use viewer, editor, promoter or admin"))
        })
    }
}

/// Who is calling: the token's id, name and role.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operator {
    pub token_id: String,
    pub name: String,
    pub role: Role,
}

impl Operator {
    /// How audit records and promotion records name this caller.
    pub fn actor(&self) -> String {
        format!("operator:{}/{}", self.name, self.token_id)
    }
}

/// Why a presented token was refused. The texts never repeat what was presented.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    #[error(
        "the operator token is malformed: it is \"iwo_\" followed by {} characters of A-Z a-z 0-9 - _; \
         copy it again in full",
        TOKEN_LEN - OPERATOR_TOKEN_PREFIX.len()
    )]
    Malformed,
    /// Unknown id or wrong secret: the same answer for both.
    #[error("the operator token is not valid; mint one with `innerwall operator token mint`")]
    NotValid,
    #[error("the operator token {id} expired at {at}; mint a new one")]
    Expired { id: String, at: DateTime<Utc> },
    #[error("the operator token {id} was revoked at {at}; mint a new one")]
    Revoked { id: String, at: DateTime<Utc> },
    /// The check itself could not be made (the database).
    #[error(transparent)]
    Unavailable(#[from] Error),
}

/// A presented token, checked for shape: its id and the hash of its whole text.
struct Presented {
    id: String,
    hash: [u8; 32],
}

fn parse(text: &str) -> Result<Presented, Refused> {
    let body = text.strip_prefix(OPERATOR_TOKEN_PREFIX).ok_or(Refused::Malformed)?;
    if body.len() != ID_LEN + SECRET_LEN
        || !body.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(Refused::Malformed);
    }
    let (id, secret) = body.split_at(ID_LEN);
    // Only the canonical spelling: one secret, one text, one hash.
    match URL_SAFE_NO_PAD.decode(secret) {
        Ok(bytes) if bytes.len() == SECRET_BYTES => {}
        _ => return Err(Refused::Malformed),
    }
    Ok(Presented { id: id.to_owned(), hash: sha256(text) })
}

fn sha256(text: &str) -> [u8; 32] {
    let mut out = [0u8; 32];
    out.copy_from_slice(digest(&SHA256, text.as_bytes()).as_ref());
    out
}

/// Constant-time equality of two hashes (the same fold as provisioning tokens').
fn hashes_equal(stored: &[u8], presented: &[u8; 32]) -> bool {
    if stored.len() != presented.len() {
        return false;
    }
    let diff = stored.iter().zip(presented).fold(0u8, |acc, (a, b)| acc | (a ^ b));
    std::hint::black_box(diff) == 0
}

/// Checks a presented bearer token and names its holder. `last_used_at` is recorded at most
/// once a minute per token, so reads do not each write.
pub async fn authenticate(pool: &PgPool, text: &str) -> Result<Operator, Refused> {
    let presented = parse(text)?;
    let row = sqlx::query(
        "SELECT name, role, token_hash, expires_at, revoked_at, now() FROM operator_tokens WHERE id = $1",
    )
    .bind(&presented.id)
    .fetch_optional(pool)
    .await
    .map_err(Error::from)?;
    let Some(row) = row else {
        // The same comparison as for a known id, so the time taken does not tell.
        let _ = hashes_equal(&[0u8; 32], &presented.hash);
        return Err(Refused::NotValid);
    };
    let stored: Vec<u8> = row.get(2);
    if !hashes_equal(&stored, &presented.hash) {
        return Err(Refused::NotValid);
    }
    let (expires_at, revoked_at, now): (Option<DateTime<Utc>>, Option<DateTime<Utc>>, DateTime<Utc>) =
        (row.get(3), row.get(4), row.get(5));
    if let Some(at) = revoked_at {
        return Err(Refused::Revoked { id: presented.id, at });
    }
    if let Some(at) = expires_at.filter(|at| now >= *at) {
        return Err(Refused::Expired { id: presented.id, at });
    }
    let role: String = row.get(1);
    let operator = Operator { token_id: presented.id, name: row.get(0), role: role.parse()? };
    sqlx::query(
        "UPDATE operator_tokens SET last_used_at = now()
         WHERE id = $1 AND (last_used_at IS NULL OR last_used_at < now() - interval '1 minute')",
    )
    .bind(&operator.token_id)
    .execute(pool)
    .await
    .map_err(Error::from)?;
    Ok(operator)
}

/// What `mint_audited` returns; `secret` (the whole token) is shown once and stored nowhere.
/// `Debug` leaves the secret out.
#[derive(Clone, Serialize, utoipa::ToSchema)]
pub struct MintedOperatorToken {
    pub id: String,
    pub name: String,
    pub role: Role,
    pub expires_at: Option<DateTime<Utc>>,
    /// The token: `iwo_…`.
    pub token: String,
}

impl fmt::Debug for MintedOperatorToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MintedOperatorToken")
            .field("id", &self.id)
            .field("name", &self.name)
            .field("role", &self.role)
            .field("expires_at", &self.expires_at)
            .finish_non_exhaustive()
    }
}

/// One row of `innerwall operator token list`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct OperatorTokenView {
    pub id: String,
    pub name: String,
    pub role: Role,
    pub created_at: DateTime<Utc>,
    pub created_by: String,
    pub expires_at: Option<DateTime<Utc>>,
    pub revoked_at: Option<DateTime<Utc>>,
    pub last_used_at: Option<DateTime<Utc>>,
    /// `active`, `expired` or `revoked`.
    pub status: &'static str,
}

fn check_name(name: &str) -> Result<(), Error> {
    // Checked first: any id-shaped text (even one ending in "-") gets the reason that matters.
    if is_id_shaped(name) {
        return Err(Error::Invalid(format!(
            "operator token name {name:?} has the shape of a token id ({ID_LEN} characters without a \".\"), \
             so it could be read as another token's id; choose a longer or shorter name, or one with a \".\""
        )));
    }
    let bytes = name.as_bytes();
    let edge = |b: Option<&u8>| b.is_some_and(u8::is_ascii_alphanumeric);
    let ok = (1..=MAX_NAME).contains(&bytes.len())
        && edge(bytes.first())
        && edge(bytes.last())
        && bytes.iter().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if !ok {
        return Err(Error::Invalid(format!(
            "operator token name {name:?} is not valid: 1 to {MAX_NAME} characters of A-Z a-z 0-9 . _ -, \
             starting and ending with a letter or digit"
        )));
    }
    Ok(())
}

fn random<const N: usize>() -> Result<[u8; N], Error> {
    let mut bytes = [0u8; N];
    SystemRandom::new()
        .fill(&mut bytes)
        .map_err(|_| Error::Invalid("the system random number generator failed".into()))?;
    Ok(bytes)
}

/// Mints a token named `name` with `role`, valid for `expires` (`Expiry::default()`: 90 days;
/// `Expiry::Never`: until revoked), and records who minted it (`operator-token.mint`) in the
/// same transaction. A live token's name is unique.
pub async fn mint_audited(
    pool: &PgPool,
    actor: &str,
    name: &str,
    role: Role,
    expires: Expiry,
) -> Result<MintedOperatorToken, Error> {
    mint_audited_within(pool, actor, name, role, expires, &crate::counts::CountBounds::default()).await
}

/// [`mint_audited`], refused when as many live tokens as `counts` allows exist already.
pub async fn mint_audited_within(
    pool: &PgPool,
    actor: &str,
    name: &str,
    role: Role,
    expires: Expiry,
    counts: &crate::counts::CountBounds,
) -> Result<MintedOperatorToken, Error> {
    check_name(name)?;
    let expires = match expires {
        Expiry::After(ttl) => Some(ttl),
        Expiry::Never => None,
    };
    if let Some(ttl) = expires
        && (ttl <= chrono::Duration::zero() || ttl > chrono::Duration::days(MAX_EXPIRY_DAYS))
    {
        return Err(Error::Invalid(format!(
            "an operator token expires after more than 0 and at most {MAX_EXPIRY_DAYS} days, not {ttl}"
        )));
    }
    let mut tx = pool.begin().await?;
    let live: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM operator_tokens WHERE name = $1 AND revoked_at IS NULL)",
    )
    .bind(name)
    .fetch_one(&mut *tx)
    .await?;
    if live {
        return Err(Error::Exists { what: "live operator token", name: name.to_owned() });
    }
    counts.check(&mut tx, crate::counts::Counted::OperatorTokens).await?;
    let id = URL_SAFE_NO_PAD.encode(random::<ID_BYTES>()?);
    let token = format!("{OPERATOR_TOKEN_PREFIX}{id}{}", URL_SAFE_NO_PAD.encode(random::<SECRET_BYTES>()?));
    // A concurrent mint of the same name meets the unique index here and fails as a conflict;
    // an id collision (48 random bits) fails the same way and is retried by minting again.
    let expires_at: Option<DateTime<Utc>> = sqlx::query_scalar(
        "INSERT INTO operator_tokens (id, name, role, token_hash, created_by, expires_at)
         VALUES ($1, $2, $3, $4, $5, now() + $6) RETURNING expires_at",
    )
    .bind(&id)
    .bind(name)
    .bind(role.name())
    .bind(sha256(&token).as_slice())
    .bind(actor)
    .bind(expires)
    .fetch_one(&mut *tx)
    .await
    .map_err(|e| match &e {
        sqlx::Error::Database(d) if d.is_unique_violation() => {
            Error::Exists { what: "live operator token", name: name.to_owned() }
        }
        _ => Error::from(e),
    })?;
    let subject = format!("{name}/{id}");
    let detail = serde_json::json!({"role": role.name(), "expires_at": expires_at});
    audit::write(&mut tx, &audit::Record::new(actor, "operator-token.mint", &subject).detail(detail)).await?;
    tx.commit().await?;
    Ok(MintedOperatorToken { id, name: name.to_owned(), role, expires_at, token })
}

/// Every operator token, newest first, with its status now.
pub async fn list(conn: &mut PgConnection) -> Result<Vec<OperatorTokenView>, Error> {
    views(conn, None, i64::MAX).await
}

const OPERATOR_TOKENS: &str = "operator token list";

/// A page of the operator tokens, newest first (OPS-2).
pub async fn page(
    conn: &mut PgConnection,
    request: &crate::page::PageRequest,
) -> Result<crate::page::Page<OperatorTokenView>, Error> {
    use crate::page;
    let kind = OPERATOR_TOKENS;
    let limit = request.checked_limit()?;
    let cursor_key = page::cursor_key(&mut *conn).await?;
    let after = request.after_pair::<DateTime<Utc>, String>(&cursor_key, kind)?;
    let rows = views(conn, after, limit + 1).await?;
    Ok(page::page(&cursor_key, rows, limit, kind, |v| serde_json::json!([v.created_at, v.id])))
}

/// Up to `limit` operator tokens after `after` (a created_at and id), newest first.
async fn views(
    conn: &mut PgConnection,
    after: Option<(DateTime<Utc>, String)>,
    limit: i64,
) -> Result<Vec<OperatorTokenView>, Error> {
    let (after_at, after_id) = after.unzip();
    let rows = sqlx::query(
        "SELECT id, name, role, created_at, created_by, expires_at, revoked_at, last_used_at, now()
         FROM operator_tokens
         WHERE $1::timestamptz IS NULL OR created_at < $1 OR (created_at = $1 AND id > $2)
         ORDER BY created_at DESC, id LIMIT $3",
    )
    .bind(after_at)
    .bind(after_id)
    .bind(limit)
    .fetch_all(&mut *conn)
    .await?;
    rows.into_iter()
        .map(|row| {
            let role: String = row.get(2);
            let (expires_at, revoked_at, now): (Option<DateTime<Utc>>, Option<DateTime<Utc>>, DateTime<Utc>) =
                (row.get(5), row.get(6), row.get(8));
            let status = match (revoked_at, expires_at) {
                (Some(_), _) => "revoked",
                (None, Some(at)) if now >= at => "expired",
                _ => "active",
            };
            Ok(OperatorTokenView {
                id: row.get(0),
                name: row.get(1),
                role: role
                    .parse()
                    .map_err(|_| Error::Corrupt { what: "operator token role", detail: role })?,
                created_at: row.get(3),
                created_by: row.get(4),
                expires_at,
                revoked_at,
                last_used_at: row.get(7),
                status,
            })
        })
        .collect()
}

/// Revokes the token `which` (by id: that token, revoked or not; by name: the live token of
/// that name), effective on its next request, and records it (`operator-token.revoke`, with
/// `reason` in its detail when given). Revoking a revoked token by id keeps the first
/// revocation time.
pub async fn revoke_audited(
    pool: &PgPool,
    actor: &str,
    which: &TokenRef,
    reason: Option<&str>,
) -> Result<OperatorTokenView, Error> {
    let mut tx = pool.begin().await?;
    let (sql, key, what) = match which {
        TokenRef::Id(id) => {
            if !is_id_shaped(id) {
                return Err(Error::Invalid(format!(
                    "{id:?} is not an operator token id ({ID_LEN} characters of A-Z a-z 0-9 - _, as \
                     `innerwall operator token list` shows); to revoke by name, give the name instead (--name)"
                )));
            }
            (
                "UPDATE operator_tokens SET revoked_at = COALESCE(revoked_at, now()) WHERE id = $1
                 RETURNING id, name",
                id,
                "operator token with id",
            )
        }
        TokenRef::Name(name) => (
            "UPDATE operator_tokens SET revoked_at = now() WHERE name = $1 AND revoked_at IS NULL
             RETURNING id, name",
            name,
            "live operator token named",
        ),
    };
    let row: Option<(String, String)> = sqlx::query_as(sql).bind(key).fetch_optional(&mut *tx).await?;
    let Some((id, name)) = row else {
        return Err(Error::NotFound { what, name: key.clone() });
    };
    let subject = format!("{name}/{id}");
    let mut record = audit::Record::new(actor, "operator-token.revoke", &subject);
    if let Some(reason) = reason {
        record = record.detail(serde_json::json!({ "reason": reason }));
    }
    audit::write(&mut tx, &record).await?;
    tx.commit().await?;
    let mut conn = pool.acquire().await?;
    let view = list(&mut conn).await?.into_iter().find(|t| t.id == id);
    view.ok_or_else(|| Error::NotFound { what: "operator token", name: id })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token() -> String {
        let id = URL_SAFE_NO_PAD.encode([7u8; ID_BYTES]);
        format!("{OPERATOR_TOKEN_PREFIX}{id}{}", URL_SAFE_NO_PAD.encode([9u8; SECRET_BYTES]))
    }

    #[test]
    fn tokens_parse_only_in_their_one_spelling() {
        let good = token();
        assert_eq!(good.len(), TOKEN_LEN);
        let parsed = parse(&good).unwrap();
        assert_eq!(parsed.id, &good[4..12]);
        assert_eq!(parsed.hash, sha256(&good));
        for bad in [
            String::new(),
            good[4..].to_owned(),
            format!("iw_{}", &good[4..]),
            format!("{good}A"),
            good[..TOKEN_LEN - 1].to_owned(),
            format!("{} ", &good[..TOKEN_LEN - 1]),
            format!("{}+", &good[..TOKEN_LEN - 1]),
            // 43 characters carry 258 bits; the spare bits must be zero.
            format!("{}{}B", &good[..12], "A".repeat(42)),
        ] {
            assert!(matches!(parse(&bad), Err(Refused::Malformed)), "{bad:?}");
        }
    }

    #[test]
    fn refusals_never_repeat_the_token() {
        let good = token();
        for refusal in [
            Refused::Malformed,
            Refused::NotValid,
            Refused::Expired { id: good[4..12].into(), at: Utc::now() },
        ] {
            assert!(!refusal.to_string().contains(&good[12..]), "{refusal}");
        }
    }

    #[test]
    fn roles_are_ordered() {
        assert!(Role::Admin.allows(Role::Promoter));
        assert!(Role::Promoter.allows(Role::Editor));
        assert!(Role::Editor.allows(Role::Viewer));
        assert!(!Role::Viewer.allows(Role::Editor));
        assert!(!Role::Editor.allows(Role::Promoter));
        assert!(!Role::Promoter.allows(Role::Admin));
        for role in Role::ALL {
            assert_eq!(role.name().parse::<Role>().unwrap(), role);
        }
        assert!("root".parse::<Role>().is_err());
    }

    #[test]
    fn names_follow_the_grammar() {
        for good in ["alice", "ci-bot.2", "a", &"a".repeat(63), "deploy.1", "deployer9", "ci-bot7"] {
            check_name(good).unwrap();
        }
        // The last two have an id's shape: 8 characters of base64url.
        for bad in ["", "-a", "a-", "a b", "ä", &"a".repeat(64), "deployer", "AbC-d_e1"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        // An id may end (or start) in "-" or "_"; used as a name it is refused as id-shaped,
        // not as ill-formed, whatever its edges.
        for id_like in ["jrgoFUD-", "_rgoFUD1", "deployer"] {
            let err = check_name(id_like).unwrap_err().to_string();
            assert!(err.contains("shape of a token id"), "{id_like:?}: {err}");
        }
    }
}
