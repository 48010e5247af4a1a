//! The requests the CLI's commands make of a [`crate::backend::Backend`], with the flags they
//! come from: checked the same way before either side is asked, and turned into the library's
//! filters (on this host's database) or the API's queries (through a control plane). Below both
//! the commands and the backend, so neither imports the other's module.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use chrono::{DateTime, SecondsFormat, Utc};
use clap::Args;
use innerwall_control_plane::audit::AuditFilter;
use innerwall_control_plane::counts::CountBounds;
use innerwall_control_plane::error::Error;
use innerwall_control_plane::flows::{self as f, Grouping, PageRequest, RollupFilter};
use innerwall_control_plane::gate::{Params, Scope};
use innerwall_control_plane::identity::tokens;
use innerwall_control_plane::page::Page;
use innerwall_control_plane::policy::authoring::Committed;
use innerwall_control_plane::policy::model::Selector;
use innerwall_control_plane::suggest::{self, Request};
use innerwall_wire::flows::Decision;
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::labels::Label;
use serde::Serialize;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::api::with_query;
use crate::duration::{self, since, since_param};

/// The workloads a verdict or mode change is about.
#[derive(Debug, clap::Args)]
#[group(required = true, multiple = false)]
pub struct ScopeArgs {
    /// A label selector, `key=value`, several values `key=v1|v2`, keys ANDed with commas
    /// (`app=web,env=prod|staging`), resolved to the live workloads in it now.
    #[arg(long)]
    pub scope: Option<String>,
    /// Workload ids (repeat the flag).
    #[arg(long = "id")]
    pub ids: Vec<WorkloadId>,
}

impl ScopeArgs {
    pub fn scope(&self) -> anyhow::Result<Scope> {
        Ok(match &self.scope {
            Some(text) => Scope::parse_selector(text)?,
            None => Scope::ids(self.ids.clone())?,
        })
    }
}

/// The evidence a verdict judges.
#[derive(Debug, clap::Args)]
pub struct EvidenceArgs {
    /// The evidence range: from this long ago until now.
    #[arg(long, default_value = "24h", value_parser = duration::arg)]
    evidence_since: Duration,
    /// A shorter range is never enough evidence.
    #[arg(long, default_value = "24h", value_parser = duration::arg)]
    min_evidence: Duration,
}

impl EvidenceArgs {
    /// The evidence until now. The remote CLI checks it here too, and sends the durations for
    /// the API to end at its own now.
    pub fn params(&self) -> anyhow::Result<Params> {
        let now = Utc::now().timestamp_millis();
        Ok(Params::ending_at(now, self.evidence_since, self.min_evidence)?)
    }

    /// `evidence_since` and `min_evidence` as the API reads them.
    pub fn texts(&self) -> (String, String) {
        let text = |d| humantime::format_duration(d).to_string();
        (text(self.evidence_since), text(self.min_evidence))
    }
}

#[derive(Debug, Args)]
pub struct SuggestArgs {
    /// The destinations to suggest rules for, as a selector (`app=payments-db`).
    #[arg(long)]
    scope: Option<String>,
    /// The recorded range: from this long ago until now (at most 90 days).
    #[arg(long, default_value = "14d", value_parser = duration::arg)]
    since: Duration,
    /// The range's end (RFC 3339; default now): the same flows and end give the same output.
    #[arg(long, value_name = "TIME")]
    until: Option<DateTime<Utc>>,
    /// A label key that names a host rather than a role (repeatable): left out of destination
    /// groups and source selectors.
    #[arg(long = "exclude-key", value_name = "KEY")]
    exclude_keys: Vec<String>,
    /// The most workloads a source selector may pick now per observed source workload.
    #[arg(long, default_value_t = suggest::DEFAULT_MAX_BREADTH)]
    max_breadth: f64,
    /// Also write each destination group's ruleset file (`ruleset create -f` reads it) here.
    #[arg(long, value_name = "DIR")]
    pub out_dir: Option<PathBuf>,
}

impl SuggestArgs {
    fn scope(&self) -> anyhow::Result<&str> {
        self.scope
            .as_deref()
            .context("innerwall suggest needs --scope SELECTOR (e.g. --scope app=payments-db)")
    }

    /// The request the flags make, ending now unless `--until` says when.
    pub fn request(&self) -> anyhow::Result<Request> {
        Ok(Request {
            scope: self.scope()?.to_owned(),
            range: suggest::range_since(self.until.unwrap_or_else(Utc::now), self.since)?,
            excluded_keys: self.exclude_keys.iter().cloned().collect(),
            max_breadth: self.max_breadth,
        })
    }

    /// The API's query for the same request (the API ends it at its own now unless `until`).
    pub fn query(&self) -> anyhow::Result<Vec<(&'static str, String)>> {
        self.request()?;
        let mut query = vec![
            ("scope", self.scope()?.to_owned()),
            ("since", since_param(&self.since)),
            ("max_breadth", self.max_breadth.to_string()),
        ];
        if let Some(until) = self.until {
            query.push(("until", until.to_rfc3339()));
        }
        if !self.exclude_keys.is_empty() {
            query.push(("exclude_keys", self.exclude_keys.join(",")));
        }
        Ok(query)
    }
}

/// A minted token as the API answers it, and as a local mint becomes.
#[derive(Debug, serde::Deserialize)]
pub struct Minted {
    pub id: Uuid,
    pub token: String,
    pub expires_at: DateTime<Utc>,
}

impl From<tokens::MintedToken> for Minted {
    fn from(minted: tokens::MintedToken) -> Minted {
        Minted { id: minted.id, token: minted.secret.clone(), expires_at: minted.expires_at }
    }
}

/// `audit list`'s filter as given: `since` is measured back from now where the database is.
pub struct AuditQuery {
    pub actor: Option<String>,
    pub action: Option<String>,
    pub object: Option<String>,
    pub since: Option<Duration>,
}

impl AuditQuery {
    /// The library's filter, `since` back from now.
    pub fn filter(&self) -> AuditFilter {
        AuditFilter {
            actor: self.actor.clone(),
            action: self.action.clone(),
            object: self.object.clone(),
            since: self.since.as_ref().map(since),
        }
    }

    /// `GET /api/v1/audit` with the same filter.
    pub fn path(&self) -> String {
        let mut query = Vec::new();
        for (name, value) in [("actor", &self.actor), ("action", &self.action), ("object", &self.object)] {
            if let Some(value) = value {
                query.push((name, value.clone()));
            }
        }
        if let Some(back) = &self.since {
            query.push(("since", since_param(back)));
        }
        with_query("/api/v1/audit", &query)
    }
}

/// A named, versioned object an operator creates, updates, deletes and lists from flags: the
/// flags (`Self`), the spec they parse into, and the library calls and view for it.
pub trait Catalog: Args {
    /// As messages name it: `service`, `address group`.
    const NOUN: &'static str;
    /// The members' table column and the API body's key: `entries`, `cidrs`.
    const MEMBERS: &'static str;
    /// The API's collection: `/api/v1/services`, `/api/v1/address-groups`.
    const PATH: &'static str;
    type Spec;
    type View: Serialize + serde::de::DeserializeOwned;

    fn spec(&self) -> anyhow::Result<Self::Spec>;
    /// The API's body for a create (with the name) or an update (without).
    fn body(&self, with_name: bool) -> serde_json::Value;
    fn arg_name(&self) -> &str;
    /// `operations::create_…`.
    async fn create(
        pool: &PgPool,
        actor: &str,
        spec: &Self::Spec,
        counts: &CountBounds,
    ) -> Result<Committed<()>, Error>;
    /// `operations::update_…`: the new version.
    async fn update(
        pool: &PgPool,
        actor: &str,
        spec: &Self::Spec,
        expected: i64,
    ) -> Result<Committed<i64>, Error>;
    /// `operations::delete_…`.
    async fn delete(pool: &PgPool, actor: &str, name: &str, expected: i64) -> Result<Committed<()>, Error>;
    async fn page(conn: &mut PgConnection, request: &PageRequest) -> Result<Page<Self::View>, Error>;
    async fn show(conn: &mut PgConnection, name: &str) -> Result<Self::View, Error>;
    /// name, version, members, description.
    fn row(view: Self::View) -> Vec<String>;
}

/// The range of a rollup as given: `--from`/`--to`, `--since`, or the last hour.
pub enum Range {
    Between { from: DateTime<Utc>, to: Option<DateTime<Utc>> },
    Since(Duration),
}

/// A rollup's flags, checked (in this order, in both modes) before anything is asked.
pub struct Rollup {
    pub by: Grouping,
    pub range: Range,
    pub decisions: Vec<Decision>,
    pub peer_labels: Vec<Label>,
    pub versions: Vec<u64>,
    pub workloads: Vec<WorkloadId>,
    /// The scope as written (the API parses it the same way) and parsed.
    pub scope: Option<(String, Selector)>,
}

impl Rollup {
    /// The library's filter over the range ending now, within `--workload`s (the scope is the
    /// caller's to resolve).
    pub fn filter(&self) -> RollupFilter {
        let now = Utc::now();
        let (start, end) = match self.range {
            Range::Between { from, to } => (from, to.unwrap_or(now)),
            Range::Since(back) => (since(&back), now),
        };
        let filter = RollupFilter {
            decisions: self.decisions.clone(),
            peer_labels: self.peer_labels.clone(),
            versions: self.versions.clone(),
            ..RollupFilter::range(start, end)
        };
        match self.workloads.is_empty() {
            true => filter,
            false => filter.within(self.workloads.iter().copied().collect()),
        }
    }

    /// The query string of `GET /api/v1/flows/rollup`.
    pub fn query(&self, request: &PageRequest) -> String {
        let joined = |values: Vec<String>| values.join(",");
        let mut q = vec![("by", self.by.name().to_owned())];
        if !self.workloads.is_empty() {
            q.push(("workload", joined(self.workloads.iter().map(ToString::to_string).collect())));
        }
        if let Some((text, _)) = &self.scope {
            q.push(("scope", text.clone()));
        }
        if !self.peer_labels.is_empty() {
            q.push(("peer_label", joined(self.peer_labels.iter().map(ToString::to_string).collect())));
        }
        if !self.decisions.is_empty() {
            q.push(("decision", joined(self.decisions.iter().map(|d| d.name().to_owned()).collect())));
        }
        if !self.versions.is_empty() {
            q.push(("version", joined(self.versions.iter().map(ToString::to_string).collect())));
        }
        match &self.range {
            Range::Between { from, to } => {
                q.push(("from", from.to_rfc3339_opts(SecondsFormat::AutoSi, true)));
                if let Some(to) = to {
                    q.push(("to", to.to_rfc3339_opts(SecondsFormat::AutoSi, true)));
                }
            }
            Range::Since(back) => q.push(("since", since_param(back))),
        }
        push_page(&mut q, request);
        with_query("/api/v1/flows/rollup", &q)
    }
}

/// `limit` and `cursor`, passed through as given.
pub fn push_page(q: &mut Vec<(&'static str, String)>, request: &PageRequest) {
    q.push(("limit", request.limit.to_string()));
    if let Some(cursor) = &request.cursor {
        q.push(("cursor", cursor.clone()));
    }
}

/// `flows list`'s filter as given: `since` is measured back from now where the database is.
pub struct RecordQuery {
    pub workload: WorkloadId,
    pub since: Duration,
    pub decision: Option<Decision>,
    pub version: Option<u64>,
}

impl RecordQuery {
    /// The library's filter, `since` back from now.
    pub fn filter(&self) -> f::RecordFilter {
        f::RecordFilter {
            workload: self.workload,
            since: since(&self.since),
            decision: self.decision,
            version: self.version,
        }
    }

    /// The query string of `GET /api/v1/flows`.
    pub fn path(&self, request: &PageRequest) -> String {
        let mut q = vec![("workload", self.workload.to_string()), ("since", since_param(&self.since))];
        if let Some(decision) = self.decision {
            q.push(("decision", decision.name().to_owned()));
        }
        if let Some(version) = self.version {
            q.push(("version", version.to_string()));
        }
        push_page(&mut q, request);
        with_query("/api/v1/flows", &q)
    }
}

/// The query string of `GET /api/v1/flows/gaps`.
pub fn gaps_path(workload: Option<WorkloadId>, back: &Duration, request: &PageRequest) -> String {
    let mut q = vec![("since", since_param(back))];
    if let Some(workload) = workload {
        q.push(("workload", workload.to_string()));
    }
    push_page(&mut q, request);
    with_query("/api/v1/flows/gaps", &q)
}
