//! Provisioning tokens (IDN-1): minting, listing, revoking, and consuming one inside the
//! enrollment transaction.
//!
//! A token is `iw_` + base64url (no padding) of 32 random bytes. Only its SHA-256 is stored,
//! next to a short prefix hint that finds candidate rows; the hash comparison itself is constant
//! time. The secret is shown once, at mint, and never appears in an error or a log line.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use chrono::{DateTime, Utc};
use innerwall_wire::labels::Label;
use innerwall_wire::policy::Cidr;
use ring::digest::{SHA256, digest};
use ring::rand::{SecureRandom, SystemRandom};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, Row};
use uuid::Uuid;

use crate::policy::spec::MAX_TOKEN_RANGES;

/// Every token starts with this, so secret scanners can spot a leaked one.
pub const TOKEN_PREFIX: &str = "iw_";
const SECRET_BYTES: usize = 32;
/// base64url without padding of [`SECRET_BYTES`].
const ENCODED_LEN: usize = 43;
/// Characters after the prefix kept in clear as `prefix_hint`.
pub const PREFIX_HINT_LEN: usize = 6;
pub const DEFAULT_TTL_DAYS: i64 = 30;
pub const MAX_TTL_DAYS: i64 = 365;

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error(
        "provisioning token is malformed ({reason}); a token is \"iw_\" followed by 43 characters \
         of A-Z a-z 0-9 - _ — copy it again in full"
    )]
    Malformed { reason: String },
    #[error("unknown provisioning token {hint}…; check that it was copied from `innerwall token mint`")]
    Unknown { hint: String },
    #[error("provisioning token {hint}… was revoked at {revoked_at}; ask an operator for a new token")]
    Revoked { hint: String, revoked_at: DateTime<Utc> },
    #[error("provisioning token {hint}… expired at {expires_at}; ask an operator for a new token")]
    Expired { hint: String, expires_at: DateTime<Utc> },
    #[error(
        "provisioning token {hint}… is used up ({use_count} of {max_uses} uses); ask an operator \
         for a new token"
    )]
    Exhausted { hint: String, use_count: u32, max_uses: u32 },
    #[error("provisioning token {0} not found")]
    NotFound(Uuid),
    #[error("{0}")]
    Invalid(String),
    /// As many live tokens as the bound exist already (`counts`): its value.
    #[error("{}", crate::counts::over(crate::counts::Counted::ProvisioningTokens, *.0))]
    OverBound(u64),
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
}

/// A refused token is `Error::Token` (who presented it is not authenticated); a bad mint is
/// invalid input, an unknown id not found, and the database the database, so minting and
/// revoking through the API answer 400, 404 or 503, never 401.
impl From<TokenError> for crate::error::Error {
    fn from(e: TokenError) -> Self {
        use crate::error::Error;
        match e {
            TokenError::Invalid(text) => Error::Invalid(text),
            TokenError::NotFound(id) => Error::NotFound { what: "provisioning token", name: id.to_string() },
            TokenError::Database(e) => Error::Database(e),
            TokenError::OverBound(limit) => {
                crate::counts::over(crate::counts::Counted::ProvisioningTokens, limit)
            }
            e => Error::Token { kind: e.kind(), error: Box::new(e) },
        }
    }
}

impl TokenError {
    /// A stable short code per variant for status messages and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            TokenError::Malformed { .. } => "malformed",
            TokenError::Unknown { .. } => "unknown",
            TokenError::Revoked { .. } => "revoked",
            TokenError::Expired { .. } => "expired",
            TokenError::Exhausted { .. } => "exhausted",
            TokenError::NotFound(_) => "not_found",
            TokenError::Invalid(_) => "invalid",
            TokenError::OverBound(_) => "over_bound",
            TokenError::Database(_) => "database",
        }
    }
}

/// A well-formed token. `Debug` shows only the prefix hint.
#[derive(Clone, PartialEq, Eq)]
pub struct TokenSecret(String);

impl fmt::Debug for TokenSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TokenSecret({}…)", self.display_hint())
    }
}

impl TokenSecret {
    fn generate() -> Result<Self, TokenError> {
        let mut bytes = [0u8; SECRET_BYTES];
        SystemRandom::new()
            .fill(&mut bytes)
            .map_err(|_| TokenError::Invalid("the system random number generator failed".into()))?;
        Ok(Self(format!("{TOKEN_PREFIX}{}", URL_SAFE_NO_PAD.encode(bytes))))
    }

    /// The full token text; print it once, never log it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The first [`PREFIX_HINT_LEN`] characters after `iw_`, as stored and listed.
    pub fn prefix_hint(&self) -> &str {
        &self.0[TOKEN_PREFIX.len()..TOKEN_PREFIX.len() + PREFIX_HINT_LEN]
    }

    fn display_hint(&self) -> String {
        format!("{TOKEN_PREFIX}{}", self.prefix_hint())
    }

    /// SHA-256 of the full token text: all the database ever holds of the secret.
    fn hash(&self) -> [u8; 32] {
        let mut out = [0u8; 32];
        out.copy_from_slice(digest(&SHA256, self.0.as_bytes()).as_ref());
        out
    }
}

/// Checks prefix, length and alphabet, after trimming surrounding whitespace (copy-paste from a
/// terminal or a file brings newlines). Whitespace inside the token is malformed. Only the
/// canonical encoding is accepted, so one secret has one spelling and one hash.
pub fn parse(text: &str) -> Result<TokenSecret, TokenError> {
    let malformed = |reason: String| TokenError::Malformed { reason };
    let text = text.trim();
    let Some(body) = text.strip_prefix(TOKEN_PREFIX) else {
        return Err(malformed("it does not start with \"iw_\"".into()));
    };
    if let Some((pos, _)) =
        body.char_indices().find(|(_, c)| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_'))
    {
        return Err(malformed(format!("character {} after \"iw_\" is not base64url", pos + 1)));
    }
    if body.len() != ENCODED_LEN {
        return Err(malformed(format!("it has {} characters after \"iw_\", not {ENCODED_LEN}", body.len())));
    }
    match URL_SAFE_NO_PAD.decode(body) {
        Ok(bytes) if bytes.len() == SECRET_BYTES => Ok(TokenSecret(text.to_owned())),
        _ => Err(malformed("its last character is not a valid ending".into())),
    }
}

/// What `mint` returns; `secret` (the full token text) is shown once and stored nowhere.
/// `Debug` leaves the secret out.
#[derive(Clone)]
pub struct MintedToken {
    pub id: Uuid,
    pub secret: String,
    /// The first six characters after `iw_`, as stored.
    pub prefix_hint: String,
    pub expires_at: DateTime<Utc>,
}

impl fmt::Debug for MintedToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MintedToken")
            .field("id", &self.id)
            .field("prefix_hint", &self.prefix_hint)
            .field("expires_at", &self.expires_at)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum TokenStatus {
    Active,
    Expired,
    Revoked,
    Exhausted,
}

impl fmt::Display for TokenStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TokenStatus::Active => "active",
            TokenStatus::Expired => "expired",
            TokenStatus::Revoked => "revoked",
            TokenStatus::Exhausted => "exhausted",
        })
    }
}

/// A token's status at `now`, in the order `consume` checks: revoked, expired, exhausted.
pub fn status_at(
    now: DateTime<Utc>,
    revoked_at: Option<DateTime<Utc>>,
    expires_at: DateTime<Utc>,
    max_uses: Option<u32>,
    use_count: u32,
) -> TokenStatus {
    if revoked_at.is_some() {
        TokenStatus::Revoked
    } else if now >= expires_at {
        TokenStatus::Expired
    } else if max_uses.is_some_and(|max| use_count >= max) {
        TokenStatus::Exhausted
    } else {
        TokenStatus::Active
    }
}

/// One row of `innerwall token list`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TokenView {
    pub id: Uuid,
    /// The first six characters after `iw_`, as stored (show it as `iw_<hint>…`).
    pub prefix_hint: String,
    /// `k=v`, sorted.
    pub labels: Vec<String>,
    /// The address ranges workloads it enrolls may claim (empty: the estate ranges alone).
    pub address_ranges: Vec<String>,
    pub created_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub max_uses: Option<u32>,
    pub use_count: u32,
    pub revoked_at: Option<DateTime<Utc>>,
    pub status: TokenStatus,
}

/// A token accepted by `consume`: who enrolled, and the labels the workload gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumedToken {
    pub id: Uuid,
    /// Sorted by key.
    pub labels: Vec<Label>,
    /// The address ranges the token narrows its workloads to (empty: not narrowed).
    pub ranges: Vec<Cidr>,
}

/// Mints a token for `labels`, valid for `ttl` (0 < ttl ≤ 365 days) and at most `max_uses`
/// enrollments (unlimited when `None`). A token must carry at least one label: an unlabeled
/// workload is matched by no selector, which is never what an operator minting a token wants.
/// At most the default count bound of live tokens ([`mint_within`] takes another).
pub async fn mint(
    conn: &mut PgConnection,
    labels: &[Label],
    ttl: chrono::Duration,
    max_uses: Option<u32>,
    ranges: &[Cidr],
) -> Result<MintedToken, TokenError> {
    mint_within(conn, labels, ttl, max_uses, ranges, &crate::counts::CountBounds::default()).await
}

/// [`mint`], refused when as many live tokens as `counts` allows exist already.
pub async fn mint_within(
    conn: &mut PgConnection,
    labels: &[Label],
    ttl: chrono::Duration,
    max_uses: Option<u32>,
    ranges: &[Cidr],
    counts: &crate::counts::CountBounds,
) -> Result<MintedToken, TokenError> {
    if ttl <= chrono::Duration::zero() {
        return Err(TokenError::Invalid(format!("ttl must be positive, got {ttl}")));
    }
    if ttl > chrono::Duration::days(MAX_TTL_DAYS) {
        return Err(TokenError::Invalid(format!(
            "ttl must be at most {MAX_TTL_DAYS} days, got {} days; mint a new token when needed",
            ttl.num_days()
        )));
    }
    let max_uses =
        match max_uses {
            Some(0) => {
                return Err(TokenError::Invalid(
                    "max uses must be at least 1 (leave it out for unlimited uses until expiry)".into(),
                ));
            }
            Some(n) => Some(i32::try_from(n).map_err(|_| {
                TokenError::Invalid(format!("max uses {n} is too large; at most {}", i32::MAX))
            })?),
            None => None,
        };
    if labels.is_empty() {
        return Err(TokenError::Invalid(
            "a token needs at least one label (--label k=v): workloads it enrolls get exactly its \
             labels, and an unlabeled workload is matched by no policy"
                .into(),
        ));
    }
    let mut keys = BTreeSet::new();
    for label in labels {
        if !keys.insert(&label.key) {
            return Err(TokenError::Invalid(format!(
                "label key {:?} is given more than once; a workload has one value per key",
                label.key.as_str()
            )));
        }
    }

    if ranges.len() > MAX_TOKEN_RANGES {
        return Err(TokenError::Invalid(format!(
            "a token names at most {MAX_TOKEN_RANGES} address ranges, got {}",
            ranges.len()
        )));
    }

    let counted = crate::counts::Counted::ProvisioningTokens;
    match counts.check(conn, counted).await {
        Ok(()) => {}
        Err(crate::error::Error::Database(e)) => return Err(TokenError::Database(e)),
        Err(_) => return Err(TokenError::OverBound(counts.of(counted))),
    }
    let secret = TokenSecret::generate()?;
    let id = Uuid::new_v4();
    let expires_at: DateTime<Utc> = sqlx::query_scalar(
        "INSERT INTO provisioning_tokens (id, token_hash, prefix_hint, expires_at, max_uses)
         VALUES ($1, $2, $3, now() + $4, $5)
         RETURNING expires_at",
    )
    .bind(id)
    .bind(secret.hash().as_slice())
    .bind(secret.prefix_hint())
    .bind(ttl)
    .bind(max_uses)
    .fetch_one(&mut *conn)
    .await?;
    let mut sorted: Vec<&Label> = labels.iter().collect();
    sorted.sort();
    for label in sorted {
        sqlx::query("INSERT INTO provisioning_token_labels (token_id, key, value) VALUES ($1, $2, $3)")
            .bind(id)
            .bind(label.key.as_str())
            .bind(label.value.as_str())
            .execute(&mut *conn)
            .await?;
    }
    let ranges: Vec<String> = ranges.iter().map(ToString::to_string).collect();
    sqlx::query(
        "INSERT INTO provisioning_token_ranges (token_id, cidr) SELECT $1, c::cidr FROM unnest($2::text[]) AS t (c)
         ON CONFLICT DO NOTHING",
    )
    .bind(id)
    .bind(&ranges)
    .execute(&mut *conn)
    .await?;
    Ok(MintedToken { id, prefix_hint: secret.prefix_hint().to_owned(), secret: secret.0, expires_at })
}

/// Every token, newest first, with its status at the database's current time.
pub async fn list(conn: &mut PgConnection) -> Result<Vec<TokenView>, TokenError> {
    views(conn, None, i64::MAX).await
}

const TOKENS: &str = "token list";

/// A page of the tokens, newest first (OPS-2).
pub async fn page(
    conn: &mut PgConnection,
    request: &crate::page::PageRequest,
) -> Result<crate::page::Page<TokenView>, crate::error::Error> {
    use crate::page;
    let limit = request.checked_limit()?;
    let cursor_key = page::cursor_key(&mut *conn).await?;
    let after = request.after_pair::<DateTime<Utc>, Uuid>(&cursor_key, TOKENS)?;
    let rows = views(conn, after, limit + 1).await?;
    Ok(page::page(&cursor_key, rows, limit, TOKENS, |v| serde_json::json!([v.created_at, v.id])))
}

/// Up to `limit` tokens after `after` (a created_at and id), newest first.
async fn views(
    conn: &mut PgConnection,
    after: Option<(DateTime<Utc>, Uuid)>,
    limit: i64,
) -> Result<Vec<TokenView>, TokenError> {
    let now: DateTime<Utc> = sqlx::query_scalar("SELECT now()").fetch_one(&mut *conn).await?;
    let rows = sqlx::query(
        "SELECT id, prefix_hint, created_at, expires_at, max_uses, use_count, revoked_at
         FROM provisioning_tokens
         WHERE $1::timestamptz IS NULL OR created_at < $1 OR (created_at = $1 AND id > $2)
         ORDER BY created_at DESC, id LIMIT $3",
    )
    .bind(after.map(|a| a.0))
    .bind(after.map(|a| a.1))
    .bind(limit)
    .fetch_all(&mut *conn)
    .await?;
    let ids: Vec<Uuid> = rows.iter().map(|row| row.get(0)).collect();
    let mut labels: BTreeMap<Uuid, Vec<String>> = BTreeMap::new();
    for row in sqlx::query(
        "SELECT token_id, key, value FROM provisioning_token_labels WHERE token_id = ANY($1) ORDER BY token_id, key",
    )
    .bind(&ids)
    .fetch_all(&mut *conn)
    .await?
    {
        let (key, value): (String, String) = (row.get(1), row.get(2));
        labels.entry(row.get(0)).or_default().push(format!("{key}={value}"));
    }
    let mut ranges: BTreeMap<Uuid, Vec<String>> = BTreeMap::new();
    for row in sqlx::query(
        "SELECT token_id, cidr::text FROM provisioning_token_ranges WHERE token_id = ANY($1) ORDER BY token_id, cidr",
    )
    .bind(&ids)
    .fetch_all(&mut *conn)
    .await?
    {
        ranges.entry(row.get(0)).or_default().push(row.get(1));
    }
    rows.into_iter()
        .map(|row| {
            let id: Uuid = row.get(0);
            let hint: String = row.get(1);
            let (max_uses, use_count) = counts(row.get(4), row.get(5))?;
            let expires_at = row.get(3);
            let revoked_at = row.get(6);
            Ok(TokenView {
                id,
                prefix_hint: hint,
                labels: labels.remove(&id).unwrap_or_default(),
                address_ranges: ranges.remove(&id).unwrap_or_default(),
                created_at: row.get(2),
                expires_at,
                max_uses,
                use_count,
                revoked_at,
                status: status_at(now, revoked_at, expires_at, max_uses, use_count),
            })
        })
        .collect()
}

/// Revokes a token at once: a `consume` waiting on its row lock sees the revocation. Revoking a
/// revoked token succeeds and keeps the first revocation time.
pub async fn revoke(conn: &mut PgConnection, id: Uuid) -> Result<(), TokenError> {
    let done =
        sqlx::query("UPDATE provisioning_tokens SET revoked_at = COALESCE(revoked_at, now()) WHERE id = $1")
            .bind(id)
            .execute(&mut *conn)
            .await?;
    if done.rows_affected() == 0 {
        return Err(TokenError::NotFound(id));
    }
    Ok(())
}

/// Validates `token_text` at `now` and counts one use. Call inside the enrollment transaction:
/// the row stays locked until it commits, and a rejection writes nothing. Checks, in order:
/// malformed, unknown, revoked, expired, exhausted.
pub async fn consume(
    conn: &mut PgConnection,
    token_text: &str,
    now: DateTime<Utc>,
) -> Result<ConsumedToken, TokenError> {
    let mut locked = lock(conn, token_text, now).await?;
    locked.take()?;
    locked.record_uses(conn).await?;
    Ok(locked.token)
}

/// An active token, its row locked by this transaction, counting the uses taken of it here.
#[derive(Debug)]
pub struct LockedToken {
    pub token: ConsumedToken,
    hint: String,
    max_uses: Option<u32>,
    /// Its stored count plus the uses taken here.
    use_count: u32,
    taken: u32,
}

impl LockedToken {
    /// Refuses the token as used up if no use is left.
    pub fn left(&self) -> Result<(), TokenError> {
        match self.max_uses.filter(|max| self.use_count >= *max) {
            Some(max_uses) => {
                Err(TokenError::Exhausted { hint: self.hint.clone(), use_count: self.use_count, max_uses })
            }
            None => Ok(()),
        }
    }

    /// Takes one use, or refuses the token as used up.
    pub fn take(&mut self) -> Result<(), TokenError> {
        self.left()?;
        self.use_count += 1;
        self.taken += 1;
        Ok(())
    }

    /// Writes the uses taken (none: nothing is written).
    pub async fn record_uses(&self, conn: &mut PgConnection) -> Result<(), TokenError> {
        if self.taken > 0 {
            sqlx::query("UPDATE provisioning_tokens SET use_count = use_count + $2 WHERE id = $1")
                .bind(self.token.id)
                .bind(i32::try_from(self.taken).unwrap_or(i32::MAX))
                .execute(&mut *conn)
                .await?;
        }
        Ok(())
    }
}

/// Validates `token_text` at `now` and locks its row until the transaction ends, taking no use
/// yet ([`LockedToken::take`]); so enrollments written together look a token up once. Checks,
/// in order: malformed, unknown, revoked, expired, exhausted.
pub async fn lock(
    conn: &mut PgConnection,
    token_text: &str,
    now: DateTime<Utc>,
) -> Result<LockedToken, TokenError> {
    let secret = parse(token_text)?;
    let hint = secret.display_hint();
    let presented = secret.hash();
    // Rows are selected by the non-secret hint; the secret-derived hash is compared in constant
    // time, over every candidate, so timing says nothing about how close a guess came.
    let candidates = sqlx::query(
        "SELECT id, token_hash, expires_at, max_uses, use_count, revoked_at
         FROM provisioning_tokens WHERE prefix_hint = $1 ORDER BY id FOR UPDATE",
    )
    .bind(secret.prefix_hint())
    .fetch_all(&mut *conn)
    .await?;
    let mut found = None;
    for row in candidates {
        let stored: Vec<u8> = row.get(1);
        if hashes_equal(&stored, &presented) {
            found = Some(row);
        }
    }
    let Some(row) = found else {
        return Err(TokenError::Unknown { hint });
    };
    let id: Uuid = row.get(0);
    let expires_at: DateTime<Utc> = row.get(2);
    let (max_uses, use_count) = counts(row.get(3), row.get(4))?;
    let revoked_at: Option<DateTime<Utc>> = row.get(5);
    match status_at(now, revoked_at, expires_at, max_uses, use_count) {
        TokenStatus::Active => {}
        TokenStatus::Revoked => {
            return Err(TokenError::Revoked { hint, revoked_at: revoked_at.unwrap_or(expires_at) });
        }
        TokenStatus::Expired => return Err(TokenError::Expired { hint, expires_at }),
        TokenStatus::Exhausted => {
            return Err(TokenError::Exhausted { hint, use_count, max_uses: max_uses.unwrap_or(use_count) });
        }
    }

    let mut labels = Vec::new();
    for row in
        sqlx::query("SELECT key, value FROM provisioning_token_labels WHERE token_id = $1 ORDER BY key")
            .bind(id)
            .fetch_all(&mut *conn)
            .await?
    {
        let (key, value): (String, String) = (row.get(0), row.get(1));
        let label = format!("{key}={value}")
            .parse::<Label>()
            .map_err(|e| TokenError::Invalid(format!("stored label of token {id} is invalid: {e}")))?;
        labels.push(label);
    }
    let ranges = token_ranges(conn, id).await?;
    Ok(LockedToken { token: ConsumedToken { id, labels, ranges }, hint, max_uses, use_count, taken: 0 })
}

async fn token_ranges(conn: &mut PgConnection, id: Uuid) -> Result<Vec<Cidr>, TokenError> {
    let texts: Vec<String> = sqlx::query_scalar(
        "SELECT cidr::text FROM provisioning_token_ranges WHERE token_id = $1 ORDER BY cidr",
    )
    .bind(id)
    .fetch_all(&mut *conn)
    .await?;
    texts
        .iter()
        .map(|t| {
            Cidr::parse_lenient(t).map_err(|e| {
                TokenError::Invalid(format!("stored address range of token {id} is invalid: {e}"))
            })
        })
        .collect()
}

/// Constant-time equality of a stored hash with the presented one. (ring 0.17.14 deprecates its
/// `constant_time::verify_slices_are_equal` as internal, so this is the same fold, kept here.)
fn hashes_equal(stored: &[u8], presented: &[u8; 32]) -> bool {
    if stored.len() != presented.len() {
        return false;
    }
    let diff = stored.iter().zip(presented).fold(0u8, |acc, (a, b)| acc | (a ^ b));
    std::hint::black_box(diff) == 0
}

fn counts(max_uses: Option<i32>, use_count: i32) -> Result<(Option<u32>, u32), TokenError> {
    let corrupt =
        || TokenError::Invalid(format!("stored use counts are corrupt ({max_uses:?}, {use_count})"));
    let max_uses = max_uses.map(u32::try_from).transpose().map_err(|_| corrupt())?;
    Ok((max_uses, u32::try_from(use_count).map_err(|_| corrupt())?))
}

/// `innerwall token mint`: mints as [`mint`] does and records who minted it (`token.mint`) in
/// the same transaction, so a token never exists without its audit record.
pub async fn mint_audited(
    pool: &sqlx::PgPool,
    actor: &str,
    labels: &[Label],
    ttl: chrono::Duration,
    max_uses: Option<u32>,
    ranges: &[Cidr],
) -> Result<MintedToken, crate::error::Error> {
    let counts = crate::counts::CountBounds::default();
    mint_audited_within(pool, actor, labels, ttl, max_uses, ranges, &counts).await
}

/// [`mint_audited`] within `counts` (the API's, from `serve`'s flags).
pub async fn mint_audited_within(
    pool: &sqlx::PgPool,
    actor: &str,
    labels: &[Label],
    ttl: chrono::Duration,
    max_uses: Option<u32>,
    ranges: &[Cidr],
    counts: &crate::counts::CountBounds,
) -> Result<MintedToken, crate::error::Error> {
    let mut tx = pool.begin().await?;
    let minted = mint_within(&mut tx, labels, ttl, max_uses, ranges, counts).await?;
    let shown: Vec<String> = labels.iter().map(ToString::to_string).collect();
    let ranges: Vec<String> = ranges.iter().map(ToString::to_string).collect();
    let detail = serde_json::json!({"labels": shown, "expires_at": minted.expires_at, "max_uses": max_uses, "address_ranges": ranges});
    let subject = minted.id.to_string();
    crate::audit::write(&mut tx, &crate::audit::Record::new(actor, "token.mint", &subject).detail(detail))
        .await?;
    tx.commit().await?;
    Ok(minted)
}

/// `innerwall token revoke`: revokes as [`revoke`] does and records it (`token.revoke`) in the
/// same transaction.
pub async fn revoke_audited(pool: &sqlx::PgPool, actor: &str, id: Uuid) -> Result<(), crate::error::Error> {
    let mut tx = pool.begin().await?;
    revoke(&mut tx, id).await?;
    crate::audit::write(&mut tx, &crate::audit::Record::new(actor, "token.revoke", &id.to_string())).await?;
    tx.commit().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minted_format_round_trips() {
        for _ in 0..50 {
            let t = TokenSecret::generate().unwrap();
            assert_eq!(t.expose().len(), 3 + 43);
            assert!(t.expose().starts_with("iw_"));
            assert_eq!(parse(t.expose()).unwrap(), t);
            assert_eq!(
                parse(&format!("  {}\r\n", t.expose())).unwrap(),
                t,
                "surrounding whitespace is trimmed"
            );
            assert_eq!(t.prefix_hint(), &t.expose()[3..9]);
        }
        assert_ne!(TokenSecret::generate().unwrap(), TokenSecret::generate().unwrap());
    }

    #[test]
    fn malformed_tokens_say_why_without_echoing() {
        let good = TokenSecret::generate().unwrap().expose().to_owned();
        let body = &good[3..];
        let check = |text: &str, want: &str| {
            let e = parse(text).unwrap_err();
            assert_eq!(e.kind(), "malformed", "{text:?}");
            let msg = e.to_string();
            assert!(msg.contains(want), "{text:?}: {msg:?} lacks {want:?}");
            assert!(!msg.contains(body), "the secret must not be echoed: {msg}");
        };
        check("", "does not start with \"iw_\"");
        check(body, "does not start with \"iw_\"");
        check(&format!("IW_{body}"), "does not start with \"iw_\"");
        check(&format!("iw_{}", &body[..42]), "42 characters after \"iw_\", not 43");
        check(&format!("{good}A"), "44 characters");
        check(&format!("iw_{}+", &body[..42]), "character 43 after \"iw_\" is not base64url");
        check(&format!("iw_{}=", &body[..42]), "character 43");
        check(&format!("iw_{} {}", &body[..20], &body[21..]), "character 21");
        check(&format!("iw_{}é", &body[..41]), "character 42");
        // 43 characters carry 258 bits; the 2 spare bits must be zero (canonical spelling).
        let last = body.as_bytes()[42];
        let twin = if last == b'A' { 'B' } else { 'A' };
        let noncanonical = format!("iw_{}{}", &body[..42], twin);
        if URL_SAFE_NO_PAD.decode(&noncanonical[3..]).is_err() {
            check(&noncanonical, "not a valid ending");
        }
        check(&format!("iw_{}B", &"A".repeat(42)), "not a valid ending");
    }

    #[test]
    fn secret_debug_shows_only_the_hint() {
        let t = TokenSecret::generate().unwrap();
        let shown = format!("{t:?}");
        assert!(shown.contains(&t.expose()[..9]));
        assert!(!shown.contains(&t.expose()[9..]));
    }

    #[test]
    fn hash_comparison() {
        let a = TokenSecret::generate().unwrap().hash();
        let mut b = a;
        assert!(hashes_equal(&a, &b));
        b[31] ^= 1;
        assert!(!hashes_equal(&b, &a));
        assert!(!hashes_equal(&a[..31], &a));
        assert!(!hashes_equal(&[], &a));
    }

    #[test]
    fn status_precedence_follows_consume_order() {
        let now = Utc::now();
        let past = now - chrono::Duration::hours(1);
        let future = now + chrono::Duration::hours(1);
        assert_eq!(status_at(now, None, future, None, 100), TokenStatus::Active);
        assert_eq!(status_at(now, None, future, Some(2), 1), TokenStatus::Active);
        assert_eq!(status_at(now, None, future, Some(2), 2), TokenStatus::Exhausted);
        assert_eq!(status_at(now, None, now, Some(2), 2), TokenStatus::Expired);
        assert_eq!(status_at(now, None, past, Some(2), 2), TokenStatus::Expired);
        assert_eq!(status_at(now, Some(past), past, Some(2), 2), TokenStatus::Revoked);
        assert_eq!(serde_json::to_string(&TokenStatus::Exhausted).unwrap(), "\"exhausted\"");
    }
}
