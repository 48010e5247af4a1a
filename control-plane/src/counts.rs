//! Count bounds on authored objects (REL-1): services, address groups, rulesets, live
//! provisioning tokens and live operator tokens. Each create checks its bound in the library
//! call that writes it (so the CLI, local or remote, and the API all get it), inside the
//! creating transaction and serialized per kind on an advisory lock, so concurrent creates
//! cannot pass it together; over the bound it is refused naming the bound and writes nothing.
//! `serve` sets the bounds with flags (the API's writes); the local CLI applies the defaults.

use sqlx::PgConnection;

use crate::error::Error;

/// What is counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Counted {
    Services,
    AddressGroups,
    Rulesets,
    /// Neither revoked nor expired (a used-up token counts until it expires).
    ProvisioningTokens,
    /// Neither revoked nor expired.
    OperatorTokens,
}

impl Counted {
    pub const ALL: [Counted; 5] = [
        Counted::Services,
        Counted::AddressGroups,
        Counted::Rulesets,
        Counted::ProvisioningTokens,
        Counted::OperatorTokens,
    ];

    pub fn what(self) -> &'static str {
        match self {
            Counted::Services => "services",
            Counted::AddressGroups => "address groups",
            Counted::Rulesets => "rulesets",
            Counted::ProvisioningTokens => "live provisioning tokens",
            Counted::OperatorTokens => "live operator tokens",
        }
    }

    /// The `serve` flag that sets the bound.
    pub fn flag(self) -> &'static str {
        match self {
            Counted::Services => "--max-services",
            Counted::AddressGroups => "--max-address-groups",
            Counted::Rulesets => "--max-rulesets",
            Counted::ProvisioningTokens => "--max-provisioning-tokens",
            Counted::OperatorTokens => "--max-operator-tokens",
        }
    }

    fn remedy(self) -> &'static str {
        match self {
            Counted::Services | Counted::AddressGroups | Counted::Rulesets => "delete one first",
            Counted::ProvisioningTokens | Counted::OperatorTokens => "revoke one first",
        }
    }

    fn count_sql(self) -> &'static str {
        match self {
            Counted::Services => "SELECT count(*) FROM services",
            Counted::AddressGroups => "SELECT count(*) FROM address_groups",
            Counted::Rulesets => "SELECT count(*) FROM rulesets",
            Counted::ProvisioningTokens => {
                "SELECT count(*) FROM provisioning_tokens WHERE revoked_at IS NULL AND expires_at > now()"
            }
            Counted::OperatorTokens => {
                "SELECT count(*) FROM operator_tokens
                 WHERE revoked_at IS NULL AND (expires_at IS NULL OR expires_at > now())"
            }
        }
    }

    /// The advisory lock creates of this kind serialize on (`iw-count` and the kind).
    fn lock_key(self) -> i64 {
        0x6977_2d63_6e74_0000 + self as i64
    }
}

/// The most of each kind that may exist at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CountBounds {
    pub services: u64,
    pub address_groups: u64,
    pub rulesets: u64,
    pub provisioning_tokens: u64,
    pub operator_tokens: u64,
}

/// Generous for an estate (a render reads every ruleset, and a list every row), small enough
/// that no script gone wrong can fill the database.
impl Default for CountBounds {
    fn default() -> Self {
        CountBounds {
            services: 5_000,
            address_groups: 5_000,
            rulesets: 2_000,
            provisioning_tokens: 10_000,
            operator_tokens: 1_000,
        }
    }
}

impl CountBounds {
    pub fn of(&self, counted: Counted) -> u64 {
        match counted {
            Counted::Services => self.services,
            Counted::AddressGroups => self.address_groups,
            Counted::Rulesets => self.rulesets,
            Counted::ProvisioningTokens => self.provisioning_tokens,
            Counted::OperatorTokens => self.operator_tokens,
        }
    }

    /// Refuses one more of `counted` if as many as the bound exist already. Call it in the
    /// creating transaction, before writing: the lock it takes is held until that commits.
    pub async fn check(&self, conn: &mut PgConnection, counted: Counted) -> Result<(), Error> {
        sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(counted.lock_key()).execute(&mut *conn).await?;
        let n: i64 = sqlx::query_scalar(counted.count_sql()).fetch_one(&mut *conn).await?;
        let limit = self.of(counted);
        if u64::try_from(n).unwrap_or(0) >= limit {
            return Err(over(counted, limit));
        }
        Ok(())
    }
}

/// The refusal of one more `counted` at `limit`.
pub fn over(counted: Counted, limit: u64) -> Error {
    Error::OverBound { what: counted.what(), limit, bound: counted.flag(), remedy: counted.remedy() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_has_its_flag_lock_and_words() {
        let mut flags = std::collections::BTreeSet::new();
        let mut keys = std::collections::BTreeSet::new();
        for c in Counted::ALL {
            assert!(flags.insert(c.flag()) && keys.insert(c.lock_key()), "{c:?} shares a flag or lock");
            assert!(CountBounds::default().of(c) > 0);
        }
        assert_eq!(
            over(Counted::Services, 3).to_string(),
            "count bound reached: 3 services exist, the most --max-services allows; delete one first, \
             or raise --max-services; nothing was changed"
        );
        assert!(over(Counted::OperatorTokens, 1).to_string().contains("revoke one first"));
    }
}
