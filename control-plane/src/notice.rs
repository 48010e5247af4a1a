//! Announcements between replicas (SYNC-7): the one NOTIFY channel, what a notice on it says,
//! and how one is published. The write side (`policy`) publishes; the LISTEN side
//! (`sync::bridge`) parses. Inside a transaction Postgres delivers a notice on commit and drops
//! it on rollback, so a notice always describes durable state.

use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::Version;
use sqlx::PgConnection;

use crate::error::Error;

/// The NOTIFY channel for policy announcements and directives.
pub const CHANNEL: &str = "innerwall_policy";

/// What one notification on [`CHANNEL`] says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// `<workload-id> <version>`: a render persisted this version.
    Policy(WorkloadId, Version),
    /// `reconnect <workload-id>`: directed reconnect (resend-snapshot).
    Reconnect(WorkloadId),
    /// `retire <workload-id>`: end its stream.
    Retire(WorkloadId),
    /// `deny <workload-id>`: refuse it at the handshake and end its stream.
    Deny(WorkloadId),
}

impl Notice {
    pub fn parse(payload: &str) -> Option<Notice> {
        let (head, tail) = payload.split_once(' ')?;
        let id = |s: &str| s.parse::<WorkloadId>().ok();
        match head {
            "reconnect" => id(tail).map(Notice::Reconnect),
            "retire" => id(tail).map(Notice::Retire),
            "deny" => id(tail).map(Notice::Deny),
            _ => Some(Notice::Policy(id(head)?, tail.parse().ok()?)),
        }
    }

    pub fn payload(&self) -> String {
        match self {
            Notice::Policy(id, v) => format!("{id} {v}"),
            Notice::Reconnect(id) => format!("reconnect {id}"),
            Notice::Retire(id) => format!("retire {id}"),
            Notice::Deny(id) => format!("deny {id}"),
        }
    }
}

/// Publishes notices on [`CHANNEL`] in one statement.
pub async fn publish(conn: &mut PgConnection, notices: &[Notice]) -> Result<(), Error> {
    let payloads: Vec<String> = notices.iter().map(Notice::payload).collect();
    sqlx::query("SELECT pg_notify($1, payload) FROM unnest($2::text[]) AS t (payload)")
        .bind(CHANNEL)
        .bind(&payloads)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_round_trip_and_garbage_is_refused() {
        let id = WorkloadId::new_random();
        for n in [Notice::Policy(id, 7), Notice::Reconnect(id), Notice::Retire(id), Notice::Deny(id)] {
            assert_eq!(Notice::parse(&n.payload()), Some(n));
        }
        for bad in
            ["", "x", "reconnect", "reconnect nope", &format!("{id}"), &format!("{id} seven"), "deny  "]
        {
            assert_eq!(Notice::parse(bad), None, "{bad:?}");
        }
    }
}
