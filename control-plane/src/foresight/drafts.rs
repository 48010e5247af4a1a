//! Drafts (issue 27 item 1, POL-8): a named, stored set of authored changes — services, address
//! groups and rulesets put or deleted, label edits, mode changes — each against the version of
//! its object the draft was based on. A draft renders without committing ([`render`]: every
//! change applied and the estate rendered in a transaction that is rolled back), so the deltas
//! and next versions it shows are the ones the commit then persists; its impact on recorded
//! traffic ([`impact`]) replays the flows of the workloads whose rendered policy differs from
//! the applied one. [`commit`] applies all of it in one checked transaction (the policy tests
//! judge it, `foresight::commit`), refused naming every object whose base moved; a mode change
//! passes the promotion gate (`gate::promote::flip`: count-pinned, a move to enforcement needs a
//! SAFE verdict now, recorded) with no override.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::labels::{Label, LabelKey};
use innerwall_wire::policy::{Mode, WorkloadPolicy, diff};
use prost::Message;
use serde::{Deserialize, Serialize};
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Row};
use uuid::Uuid;

use crate::audit;
use crate::counts::CountBounds;
use crate::error::Error;
use crate::foresight::impact::{self, Impact, Range};
use crate::foresight::policy_tests::{RunReport, TestResult};
use crate::gate::evidence::{self, Scope};
use crate::gate::promote::{self, Promotion};
use crate::gate::verdict::{Outcome, Params};
use crate::policy::authoring::{self, Committed};
use crate::policy::model::{ServiceEntry, validate_name};
use crate::policy::publish::{self, Changed, Overflow};
use crate::policy::spec::{AddressGroupSpec, RulesetSpec, ServiceSpec};
use crate::policy::store;

/// The most drafts (open and committed) that may exist at once.
pub const MAX_DRAFTS: usize = 100;
/// The most changes (objects) one draft holds.
pub const MAX_CHANGES: usize = 500;
/// The most changes one `draft add` file holds.
pub const MAX_FILE_CHANGES: usize = 100;
/// The largest change file the CLI reads and the API accepts.
pub const MAX_CHANGE_FILE: u64 = 1024 * 1024;
/// The longest note (characters).
pub const MAX_NOTE: usize = 1_024;

/// A change file (`innerwall draft add -f change.yaml`, the body of `POST …/drafts/{name}/changes`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ChangeFile {
    pub changes: Vec<ChangeSpec>,
}

/// A change file's text (YAML or JSON) read from `origin`: at most [`MAX_CHANGE_FILE`] bytes,
/// parsed by [`crate::policy::file::parse`] (no anchors or aliases, bounded nodes). Each change
/// is checked when it is added.
pub fn parse_change_file(origin: &str, text: &str) -> Result<ChangeFile, Error> {
    if text.len() as u64 > MAX_CHANGE_FILE {
        return Err(Error::Invalid(format!(
            "{origin} is larger than the {MAX_CHANGE_FILE} bytes a change file may have"
        )));
    }
    crate::policy::file::parse(origin, text)
}

/// One authored change, as an operator writes it: a map with exactly one key (`- ruleset: {…}`,
/// `- delete_service: {name: …}`, `- labels: {…}`, `- mode: {…}`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ChangeSpec {
    /// Creates the service, or replaces the one that exists when the change is added.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<NamedMembers>,
    /// Creates or replaces an address group (`members` are CIDRs in canonical spelling).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address_group: Option<NamedMembers>,
    /// Creates or replaces a ruleset (the ruleset file's form).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ruleset: Option<RulesetSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delete_service: Option<Named>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delete_address_group: Option<Named>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delete_ruleset: Option<Named>,
    /// Sets and removes labels of one workload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<LabelsChange>,
    /// Moves a set of workloads to a mode, through the promotion gate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<ModeChange>,
}

impl ChangeSpec {
    /// What the change does, in a word: `put`, `delete`, `labels`, `mode`.
    pub fn kind(&self) -> &'static str {
        if self.service.is_some() || self.address_group.is_some() || self.ruleset.is_some() {
            "put"
        } else if self.delete_service.is_some()
            || self.delete_address_group.is_some()
            || self.delete_ruleset.is_some()
        {
            "delete"
        } else if self.labels.is_some() {
            "labels"
        } else {
            "mode"
        }
    }

    pub fn service(s: NamedMembers) -> Self {
        ChangeSpec { service: Some(s), ..Default::default() }
    }
    pub fn address_group(g: NamedMembers) -> Self {
        ChangeSpec { address_group: Some(g), ..Default::default() }
    }
    pub fn ruleset(r: RulesetSpec) -> Self {
        ChangeSpec { ruleset: Some(r), ..Default::default() }
    }
    pub fn delete_service(name: &str) -> Self {
        ChangeSpec { delete_service: Some(Named { name: name.to_owned() }), ..Default::default() }
    }
    pub fn delete_address_group(name: &str) -> Self {
        ChangeSpec { delete_address_group: Some(Named { name: name.to_owned() }), ..Default::default() }
    }
    pub fn delete_ruleset(name: &str) -> Self {
        ChangeSpec { delete_ruleset: Some(Named { name: name.to_owned() }), ..Default::default() }
    }
    pub fn labels(l: LabelsChange) -> Self {
        ChangeSpec { labels: Some(l), ..Default::default() }
    }
    pub fn mode(m: ModeChange) -> Self {
        ChangeSpec { mode: Some(m), ..Default::default() }
    }
}

/// A service (`members`: `tcp:443`, `udp:53`, …) or an address group (`members`: CIDRs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NamedMembers {
    pub name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
    pub members: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Named {
    pub name: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LabelsChange {
    pub workload: String,
    /// `key=value`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub set: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remove: Vec<String>,
}

/// A mode change named by a selector or by ids, pinned to the count the operator expects.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ModeChange {
    /// `app=web,env=prod|staging` (exactly one of `selector` and `ids`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ids: Vec<String>,
    pub expect_count: usize,
    /// `visibility`, `simulation` or `enforcement`.
    pub to: String,
    pub reason: String,
    /// The evidence range a move to enforcement is judged on (default 24h).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evidence_since: Option<String>,
    /// The least evidence it needs (default 24h).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_evidence: Option<String>,
}

/// What a change's object stood at when the change was added.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Base {
    /// The object did not exist.
    Absent,
    /// The object's version (a workload's label-set version for a label change).
    Version(i64),
    /// The workloads a mode change resolved to, each with its mode, in id order.
    Members(Vec<BaseMember>),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct BaseMember {
    pub id: String,
    pub mode: String,
}

impl std::fmt::Display for Base {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Base::Absent => f.write_str("absent"),
            Base::Version(v) => write!(f, "version {v}"),
            Base::Members(ms) => {
                let ms: Vec<String> = ms.iter().map(|m| format!("{} ({})", m.id, m.mode)).collect();
                write!(f, "[{}]", ms.join(", "))
            }
        }
    }
}

/// A change parsed and checked, ready to apply.
#[derive(Debug, Clone)]
enum Change {
    PutService(ServiceSpec),
    PutGroup(AddressGroupSpec),
    PutRuleset(RulesetSpec),
    Delete(Object, String),
    Labels { workload: WorkloadId, set: Vec<Label>, remove: Vec<LabelKey> },
    Mode { scope: Scope, expect_count: usize, to: Mode, reason: String, since: Duration, min: Duration },
}

type Duration = std::time::Duration;

/// A versioned, named authored object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Object {
    Service,
    AddressGroup,
    Ruleset,
}

impl Object {
    fn table(self) -> &'static str {
        match self {
            Object::Service => "services",
            Object::AddressGroup => "address_groups",
            Object::Ruleset => "rulesets",
        }
    }

    fn key(self) -> &'static str {
        match self {
            Object::Service => "service",
            Object::AddressGroup => "address-group",
            Object::Ruleset => "ruleset",
        }
    }
}

fn duration(what: &str, text: Option<&str>) -> Result<Duration, Error> {
    match text {
        None => Ok(Duration::from_secs(24 * 3600)),
        Some(t) => humantime::parse_duration(t)
            .map_err(|e| Error::Invalid(format!("{what} {t:?} is not a duration like 24h or 7d: {e}"))),
    }
}

impl ChangeSpec {
    /// Parses and checks the change alone (no database): names, members, selectors, labels.
    fn parse(&self) -> Result<Change, Error> {
        let given = [
            self.service.is_some(),
            self.address_group.is_some(),
            self.ruleset.is_some(),
            self.delete_service.is_some(),
            self.delete_address_group.is_some(),
            self.delete_ruleset.is_some(),
            self.labels.is_some(),
            self.mode.is_some(),
        ];
        if given.iter().filter(|g| **g).count() != 1 {
            return Err(Error::Invalid(
                "a change needs exactly one of service, address_group, ruleset, delete_service, \
                 delete_address_group, delete_ruleset, labels or mode"
                    .into(),
            ));
        }
        Ok(if let Some(s) = &self.service {
            let spec = ServiceSpec {
                name: s.name.clone(),
                description: s.description.clone(),
                entries: s
                    .members
                    .iter()
                    .map(|t| ServiceEntry::parse(t).map_err(Error::from))
                    .collect::<Result<_, _>>()?,
            };
            spec.check()?;
            Change::PutService(spec)
        } else if let Some(g) = &self.address_group {
            let spec = AddressGroupSpec {
                name: g.name.clone(),
                description: g.description.clone(),
                cidrs: g
                    .members
                    .iter()
                    .map(|t| innerwall_wire::policy::Cidr::parse(t).map_err(Error::from))
                    .collect::<Result<_, _>>()?,
            };
            spec.check()?;
            Change::PutGroup(spec)
        } else if let Some(spec) = &self.ruleset {
            crate::policy::spec::validate_ruleset(spec)?;
            Change::PutRuleset(spec.clone())
        } else if let Some(n) = &self.delete_service {
            Change::Delete(Object::Service, named(&n.name)?)
        } else if let Some(n) = &self.delete_address_group {
            Change::Delete(Object::AddressGroup, named(&n.name)?)
        } else if let Some(n) = &self.delete_ruleset {
            Change::Delete(Object::Ruleset, named(&n.name)?)
        } else if let Some(l) = &self.labels {
            let workload = workload_id(&l.workload)?;
            let set = l
                .set
                .iter()
                .map(|t| t.parse::<Label>().map_err(|e| Error::Invalid(format!("label {t:?}: {e}"))))
                .collect::<Result<Vec<_>, _>>()?;
            let remove = l
                .remove
                .iter()
                .map(|t| t.parse::<LabelKey>().map_err(|e| Error::Invalid(format!("label key {t:?}: {e}"))))
                .collect::<Result<Vec<_>, _>>()?;
            authoring::check_label_edit(&set, &remove)?;
            Change::Labels { workload, set, remove }
        } else {
            let m = self.mode.as_ref().expect("exactly one is given");
            let scope = match (&m.selector, m.ids.as_slice()) {
                (Some(s), []) => Scope::parse_selector(s)?,
                (None, ids) if !ids.is_empty() => {
                    Scope::ids(ids.iter().map(|t| workload_id(t)).collect::<Result<_, _>>()?)?
                }
                _ => {
                    return Err(Error::Invalid(
                        "a mode change names its workloads by exactly one of selector and ids".into(),
                    ));
                }
            };
            let to: Mode = m.to.parse().map_err(|_| {
                Error::Invalid(format!("mode {:?} is not visibility, simulation or enforcement", m.to))
            })?;
            if m.reason.trim().is_empty() {
                return Err(Error::Invalid("a mode change needs a reason: say why".into()));
            }
            crate::input::text("the reason", &m.reason, 4 * promote::MAX_REASON)?;
            Change::Mode {
                scope,
                expect_count: m.expect_count,
                to,
                reason: m.reason.clone(),
                since: duration("evidence_since", m.evidence_since.as_deref())?,
                min: duration("min_evidence", m.min_evidence.as_deref())?,
            }
        })
    }
}

fn named(name: &str) -> Result<String, Error> {
    validate_name("object", name)?;
    Ok(name.to_owned())
}

fn workload_id(text: &str) -> Result<WorkloadId, Error> {
    text.parse::<WorkloadId>()
        .map_err(|e| Error::Invalid(format!("workload id {text:?} is not a workload id: {e}")))
}

impl Change {
    /// Where it applies among a draft's changes, whatever order they were added in: what others
    /// refer to is put before them and deleted after them; mode changes resolve their sets
    /// before label changes move workloads (as their bases were read).
    fn rank(&self) -> u8 {
        match self {
            Change::PutService(_) | Change::PutGroup(_) => 0,
            Change::PutRuleset(_) => 1,
            Change::Delete(Object::Ruleset, _) => 2,
            Change::Delete(..) => 3,
            Change::Mode { .. } => 4,
            Change::Labels { .. } => 5,
        }
    }

    /// The object it changes (one change per object per draft).
    fn object(&self) -> String {
        match self {
            Change::PutService(s) => format!("service/{}", s.name),
            Change::PutGroup(g) => format!("address-group/{}", g.name),
            Change::PutRuleset(r) => format!("ruleset/{}", r.name),
            Change::Delete(o, name) => format!("{}/{name}", o.key()),
            Change::Labels { workload, .. } => format!("labels/{workload}"),
            Change::Mode { scope, .. } => format!("mode/{scope}"),
        }
    }

    /// Its object's base now.
    async fn base(&self, conn: &mut PgConnection) -> Result<Base, Error> {
        let version = async |conn: &mut PgConnection, o: Object, name: &str| -> Result<Base, Error> {
            let sql = format!("SELECT version FROM {} WHERE name = $1", o.table());
            let v: Option<i64> =
                sqlx::query_scalar(AssertSqlSafe(sql)).bind(name).fetch_optional(&mut *conn).await?;
            Ok(v.map_or(Base::Absent, Base::Version))
        };
        match self {
            Change::PutService(s) => version(conn, Object::Service, &s.name).await,
            Change::PutGroup(g) => version(conn, Object::AddressGroup, &g.name).await,
            Change::PutRuleset(r) => version(conn, Object::Ruleset, &r.name).await,
            Change::Delete(o, name) => version(conn, *o, name).await,
            Change::Labels { workload, .. } => {
                let v: Option<i64> = sqlx::query_scalar(
                    "SELECT label_version FROM workloads WHERE id = $1 AND retired_at IS NULL",
                )
                .bind(workload.uuid())
                .fetch_optional(&mut *conn)
                .await?;
                Ok(v.map_or(Base::Absent, Base::Version))
            }
            Change::Mode { scope, .. } => {
                let members = evidence::resolve(conn, scope).await?;
                Ok(Base::Members(
                    members
                        .iter()
                        .map(|m| BaseMember { id: m.id.to_string(), mode: m.mode.to_string() })
                        .collect(),
                ))
            }
        }
    }

    /// Refuses, at `add`, a change that cannot apply to what exists now.
    fn check_base(&self, object: &str, base: &Base) -> Result<(), Error> {
        match (self, base) {
            (Change::Delete(..), Base::Absent) => {
                Err(Error::NotFound { what: "object to delete", name: object.to_owned() })
            }
            (Change::Labels { workload, .. }, Base::Absent) => {
                Err(Error::NotFound { what: "live workload", name: workload.to_string() })
            }
            (Change::Mode { expect_count, .. }, Base::Members(ms)) if ms.len() != *expect_count => {
                Err(Error::CountMismatch {
                    expected: *expect_count,
                    matched: ms.len(),
                    names: ms.iter().map(|m| m.id.clone()).collect(),
                })
            }
            (Change::Mode { .. }, Base::Members(ms)) if ms.is_empty() => {
                Err(Error::Invalid(format!("{object}: the scope names no workload: nothing to change")))
            }
            _ => Ok(()),
        }
    }

    /// Applies the change against `base` (checked unmoved) in the caller's transaction. A mode
    /// change returns its promotion record.
    async fn apply(
        &self,
        conn: &mut PgConnection,
        actor: &str,
        base: &Base,
        counts: &CountBounds,
        judged: Judged,
    ) -> Result<Option<Promotion>, Error> {
        let expected = match base {
            Base::Version(v) => Some(*v),
            _ => None,
        };
        match (self, expected) {
            (Change::PutService(s), None) => {
                authoring::create_service_within(conn, s, counts).await.map(drop)?
            }
            (Change::PutService(s), Some(v)) => authoring::update_service(conn, s, v).await.map(drop)?,
            (Change::PutGroup(g), None) => {
                authoring::create_address_group_within(conn, g, counts).await.map(drop)?
            }
            (Change::PutGroup(g), Some(v)) => authoring::update_address_group(conn, g, v).await.map(drop)?,
            (Change::PutRuleset(r), None) => {
                authoring::create_ruleset_within(conn, r, counts).await.map(drop)?
            }
            (Change::PutRuleset(r), Some(v)) => authoring::update_ruleset(conn, r, v).await.map(drop)?,
            (Change::Delete(Object::Service, n), Some(v)) => authoring::delete_service(conn, n, v).await?,
            (Change::Delete(Object::AddressGroup, n), Some(v)) => {
                authoring::delete_address_group(conn, n, v).await?
            }
            (Change::Delete(Object::Ruleset, n), Some(v)) => authoring::delete_ruleset(conn, n, v).await?,
            (Change::Labels { workload, set, remove }, Some(v)) => {
                authoring::change_labels(conn, *workload, v, set, remove).await.map(drop)?
            }
            (Change::Mode { scope, expect_count, to, reason, since, min }, _) => {
                let now = Utc::now().timestamp_millis();
                let request = promote::Request {
                    scope: scope.clone(),
                    expect_count: *expect_count,
                    to: *to,
                    params: Params::ending_at(now, *since, *min)?,
                    reason: reason.clone(),
                    // A preview notes a verdict that is not SAFE instead of refusing on it.
                    override_reason: (judged == Judged::Noted).then(|| "draft preview".to_owned()),
                    guard: None,
                    confirm_within: None,
                };
                return promote::flip(conn, actor, &request).await.map(Some);
            }
            (Change::Delete(..) | Change::Labels { .. }, None) => {
                return Err(Error::Corrupt {
                    what: "draft change",
                    detail: format!("{} has no base version", self.object()),
                });
            }
        }
        Ok(None)
    }
}

/// Whether a mode change's verdict refuses (a commit) or is noted (a preview).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Judged {
    Refused,
    Noted,
}

/// A draft as `draft show` and the API answer it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DraftView {
    pub name: String,
    pub author: String,
    pub note: String,
    pub version: i64,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub committed_at: Option<DateTime<Utc>>,
    pub committed_by: Option<String>,
    pub changes: Vec<DraftChange>,
}

/// One change of a draft with the base it was added against.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DraftChange {
    pub seq: i32,
    /// `ruleset/backend`, `labels/<id>`, `mode/app=web`, …
    pub object: String,
    pub base: Base,
    pub change: ChangeSpec,
}

/// A row of `draft list`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DraftSummary {
    pub name: String,
    pub author: String,
    pub note: String,
    pub version: i64,
    pub changes: i64,
    pub updated_at: DateTime<Utc>,
    pub committed_at: Option<DateTime<Utc>>,
}

fn check_note(note: &str) -> Result<(), Error> {
    if note.chars().count() > MAX_NOTE {
        return Err(Error::Invalid(format!("a draft's note is at most {MAX_NOTE} characters")));
    }
    crate::input::text("the note", note, 4 * MAX_NOTE)
}

async fn audited(
    conn: &mut PgConnection,
    actor: &str,
    action: &str,
    subject: &str,
    detail: serde_json::Value,
) -> Result<(), Error> {
    audit::write(conn, &audit::Record { detail, ..audit::Record::new(actor, action, subject) }).await
}

/// Creates an empty draft named `name`, authored by `actor`.
pub async fn create(pool: &PgPool, actor: &str, name: &str, note: &str) -> Result<DraftView, Error> {
    validate_name("draft", name)?;
    check_note(note)?;
    let mut tx = pool.begin().await?;
    // Serialize creates so the count bound holds (the lock is the transaction's).
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('innerwall-drafts'))").execute(&mut *tx).await?;
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM drafts").fetch_one(&mut *tx).await?;
    if count as usize >= MAX_DRAFTS {
        return Err(Error::OverBound {
            what: "drafts",
            limit: MAX_DRAFTS as u64,
            bound: "foresight::drafts::MAX_DRAFTS",
            remedy: "commit or discard a draft first",
        });
    }
    let done = sqlx::query(
        "INSERT INTO drafts (id, name, author, note) VALUES ($1, $2, $3, $4) ON CONFLICT (name) DO NOTHING",
    )
    .bind(Uuid::new_v4())
    .bind(name)
    .bind(actor)
    .bind(note)
    .execute(&mut *tx)
    .await?;
    if done.rows_affected() == 0 {
        return Err(Error::Exists { what: "draft", name: name.to_owned() });
    }
    audited(&mut tx, actor, "draft.create", name, serde_json::json!({"note": note})).await?;
    let view = view(&mut tx, name).await?;
    tx.commit().await?;
    Ok(view)
}

/// The draft row, locked for a write: its id and version, refused if committed.
async fn lock(conn: &mut PgConnection, name: &str) -> Result<(Uuid, i64), Error> {
    let row = sqlx::query("SELECT id, version, committed_at FROM drafts WHERE name = $1 FOR UPDATE")
        .bind(name)
        .fetch_optional(&mut *conn)
        .await?
        .ok_or_else(|| Error::NotFound { what: "draft", name: name.to_owned() })?;
    if let Some(at) = row.get::<Option<DateTime<Utc>>, _>(2) {
        return Err(Error::Invalid(format!(
            "draft {name:?} was committed at {at}; it is kept for the record and changes no more: create a new draft"
        )));
    }
    Ok((row.get(0), row.get(1)))
}

fn stale(name: &str, expected: i64, current: i64) -> Error {
    Error::Stale { what: "draft", name: name.to_owned(), expected, current }
}

/// A stored change, parsed again (it was checked when added; a row that no longer parses is
/// corrupt).
struct Stored {
    object: String,
    spec: ChangeSpec,
    change: Change,
    base: Base,
}

async fn stored(conn: &mut PgConnection, draft: Uuid) -> Result<Vec<Stored>, Error> {
    let rows = sqlx::query("SELECT object, change, base FROM draft_changes WHERE draft_id = $1 ORDER BY seq")
        .bind(draft)
        .fetch_all(&mut *conn)
        .await?;
    rows.into_iter()
        .map(|row| {
            let object: String = row.get(0);
            let corrupt =
                |e: String| Error::Corrupt { what: "draft change", detail: format!("{object}: {e}") };
            let spec: ChangeSpec = serde_json::from_value(row.get(1)).map_err(|e| corrupt(e.to_string()))?;
            let base: Base = serde_json::from_value(row.get(2)).map_err(|e| corrupt(e.to_string()))?;
            let change = spec.parse().map_err(|e| corrupt(e.to_string()))?;
            Ok(Stored { object, spec, change, base })
        })
        .collect()
}

/// Adds the changes of `file` to the draft, each against its object's version now (a change to
/// an object the draft already changes replaces that change and keeps its first base). The draft
/// with its new changes must apply and render (it is rendered and rolled back here); a verdict
/// or a policy test it would fail does not refuse the add (the commit judges those; `render`
/// shows them). Returns the draft.
pub async fn add(
    pool: &PgPool,
    actor: &str,
    name: &str,
    file: &ChangeFile,
    counts: &CountBounds,
) -> Result<DraftView, Error> {
    if file.changes.is_empty() {
        return Err(Error::Invalid("the change file holds no change: nothing to add".into()));
    }
    if file.changes.len() > MAX_FILE_CHANGES {
        return Err(Error::Invalid(format!(
            "a change file holds at most {MAX_FILE_CHANGES} changes, not {}",
            file.changes.len()
        )));
    }
    let parsed: Vec<Change> = file
        .changes
        .iter()
        .enumerate()
        .map(|(i, c)| c.parse().map_err(|e| Error::Invalid(format!("change {}: {e}", i + 1))))
        .collect::<Result<_, _>>()?;
    let mut tx = pool.begin().await?;
    let (id, _) = lock(&mut tx, name).await?;
    let mut objects = Vec::new();
    for (spec, change) in file.changes.iter().zip(&parsed) {
        let object = change.object();
        let kept: Option<serde_json::Value> =
            sqlx::query_scalar("SELECT base FROM draft_changes WHERE draft_id = $1 AND object = $2")
                .bind(id)
                .bind(&object)
                .fetch_optional(&mut *tx)
                .await?;
        let base = match kept {
            Some(b) => serde_json::from_value(b)
                .map_err(|e| Error::Corrupt { what: "draft base", detail: format!("{object}: {e}") })?,
            None => change.base(&mut tx).await?,
        };
        change.check_base(&object, &base)?;
        let change_json = serde_json::to_value(spec).expect("plain data serializes");
        let base_json = serde_json::to_value(&base).expect("plain data serializes");
        sqlx::query(
            "INSERT INTO draft_changes (draft_id, seq, object, change, base)
             VALUES ($1, (SELECT COALESCE(max(seq), 0) + 1 FROM draft_changes WHERE draft_id = $1), $2, $3, $4)
             ON CONFLICT (draft_id, object) DO UPDATE SET change = excluded.change",
        )
        .bind(id)
        .bind(&object)
        .bind(change_json)
        .bind(base_json)
        .execute(&mut *tx)
        .await?;
        objects.push(object);
    }
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM draft_changes WHERE draft_id = $1")
        .bind(id)
        .fetch_one(&mut *tx)
        .await?;
    if count as usize > MAX_CHANGES {
        return Err(Error::Invalid(format!(
            "draft {name:?} would hold {count} changes, more than the {MAX_CHANGES} a draft may hold; split it"
        )));
    }
    sqlx::query("UPDATE drafts SET version = version + 1, updated_at = now() WHERE id = $1")
        .bind(id)
        .execute(&mut *tx)
        .await?;
    // The whole draft must apply and render; nothing of the trial stays.
    {
        let mut trial = sqlx::Acquire::begin(&mut *tx).await?;
        let changes = stored(&mut trial, id).await?;
        apply_all(&mut trial, actor, name, &changes, counts, Judged::Noted).await?;
        publish::publish_rendering(&mut trial, Overflow::Refuse).await?;
        trial.rollback().await?;
    }
    audited(&mut tx, actor, "draft.add", name, serde_json::json!({"objects": objects})).await?;
    let view = view(&mut tx, name).await?;
    tx.commit().await?;
    Ok(view)
}

/// Refuses, naming every one, the changes whose object moved since the change was added.
async fn check_bases(conn: &mut PgConnection, name: &str, changes: &[Stored]) -> Result<(), Error> {
    let mut moved = Vec::new();
    for c in changes {
        let now = c.change.base(conn).await?;
        if now != c.base {
            moved.push(format!("{}: {} when added, {} now", c.object, c.base, now));
        }
    }
    if moved.is_empty() { Ok(()) } else { Err(Error::DraftBaseMoved { draft: name.to_owned(), moved }) }
}

/// Every change in order, after the bases are checked; the promotions of its mode changes.
async fn apply_all(
    conn: &mut PgConnection,
    actor: &str,
    name: &str,
    changes: &[Stored],
    counts: &CountBounds,
    judged: Judged,
) -> Result<Vec<Promotion>, Error> {
    // Nothing renders between reading the bases (and a mode change's evidence) and the render.
    publish::lock_renders(conn).await?;
    check_bases(conn, name, changes).await?;
    let mut ordered: Vec<&Stored> = changes.iter().collect();
    ordered.sort_by_key(|c| c.change.rank());
    let mut promotions = Vec::new();
    for c in ordered {
        let applied = c.change.apply(conn, actor, &c.base, counts, judged).await.map_err(|e| match e {
            Error::Invalid(text) => Error::Invalid(format!("draft {name:?}, {}: {text}", c.object)),
            Error::EvidenceInsufficient { outcome, reasons } => Error::EvidenceInsufficient {
                outcome,
                reasons: format!(
                    "{reasons} (the {} of draft {name:?}; a draft takes no override: move it with \
                     `innerwall workload promote --override REASON` outside the draft)",
                    c.object
                ),
            },
            e => e,
        })?;
        promotions.extend(applied);
    }
    Ok(promotions)
}

async fn view(conn: &mut PgConnection, name: &str) -> Result<DraftView, Error> {
    let row = sqlx::query(
        "SELECT id, name, author, note, version, created_at, updated_at, committed_at, committed_by
         FROM drafts WHERE name = $1",
    )
    .bind(name)
    .fetch_optional(&mut *conn)
    .await?
    .ok_or_else(|| Error::NotFound { what: "draft", name: name.to_owned() })?;
    let rows =
        sqlx::query("SELECT seq, object, change, base FROM draft_changes WHERE draft_id = $1 ORDER BY seq")
            .bind(row.get::<Uuid, _>(0))
            .fetch_all(&mut *conn)
            .await?;
    let changes = rows
        .into_iter()
        .map(|r| {
            let object: String = r.get(1);
            let corrupt = |e: serde_json::Error| Error::Corrupt {
                what: "draft change",
                detail: format!("{object}: {e}"),
            };
            Ok(DraftChange {
                seq: r.get(0),
                change: serde_json::from_value(r.get(2)).map_err(corrupt)?,
                base: serde_json::from_value(r.get(3)).map_err(corrupt)?,
                object,
            })
        })
        .collect::<Result<_, Error>>()?;
    Ok(DraftView {
        name: row.get(1),
        author: row.get(2),
        note: row.get(3),
        version: row.get(4),
        created_at: row.get(5),
        updated_at: row.get(6),
        committed_at: row.get(7),
        committed_by: row.get(8),
        changes,
    })
}

/// One draft with its changes.
pub async fn show(pool: &PgPool, name: &str) -> Result<DraftView, Error> {
    view(&mut *pool.acquire().await?, name).await
}

/// Every draft (at most [`MAX_DRAFTS`]), by name.
pub async fn list(pool: &PgPool) -> Result<Vec<DraftSummary>, Error> {
    let rows = sqlx::query(
        "SELECT d.name, d.author, d.note, d.version, (SELECT count(*) FROM draft_changes c WHERE c.draft_id = d.id),
                d.updated_at, d.committed_at
         FROM drafts d ORDER BY d.name",
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| DraftSummary {
            name: r.get(0),
            author: r.get(1),
            note: r.get(2),
            version: r.get(3),
            changes: r.get(4),
            updated_at: r.get(5),
            committed_at: r.get(6),
        })
        .collect())
}

/// Deletes a draft read at version `expected` (a committed one too: its record is the audit log's).
pub async fn discard(pool: &PgPool, actor: &str, name: &str, expected: i64) -> Result<(), Error> {
    let mut tx = pool.begin().await?;
    let current: i64 = sqlx::query_scalar("SELECT version FROM drafts WHERE name = $1 FOR UPDATE")
        .bind(name)
        .fetch_optional(&mut *tx)
        .await?
        .ok_or_else(|| Error::NotFound { what: "draft", name: name.to_owned() })?;
    if current != expected {
        return Err(stale(name, expected, current));
    }
    sqlx::query("DELETE FROM drafts WHERE name = $1").bind(name).execute(&mut *tx).await?;
    audited(&mut tx, actor, "draft.discard", name, serde_json::json!({"version": current})).await?;
    tx.commit().await?;
    Ok(())
}

/// What one workload would receive if the draft were committed now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RenderedChange {
    #[schema(value_type = String)]
    #[serde(serialize_with = "crate::gate::serialize_id", deserialize_with = "crate::gate::deserialize_id")]
    pub workload: WorkloadId,
    /// The persisted version the delta starts from (0: none, the first version is a snapshot).
    pub from_version: u64,
    /// The version the commit persists.
    pub to_version: u64,
    pub mode: String,
    /// How many changes the delta carries.
    pub delta_changes: usize,
    /// The delta a stream at `from_version` receives (`PolicyDelta`, protobuf, base64); empty
    /// for a first version.
    pub delta: String,
    /// SHA-256 (hex) of the new policy's canonical bytes.
    pub digest: String,
}

/// A draft rendered without committing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DraftRender {
    pub draft: String,
    pub draft_version: i64,
    /// Each workload whose persisted version the commit would advance, in id order.
    pub workloads: Vec<RenderedChange>,
    /// Why a commit now would be refused (a mode change's verdict that is not SAFE, failing
    /// policy tests); empty when it would pass.
    pub blockers: Vec<String>,
    /// The failing policy tests (`blockers` counts them).
    pub failing_tests: Vec<TestResult>,
}

impl DraftRender {
    pub fn would_commit(&self) -> bool {
        self.blockers.is_empty()
    }
}

/// A preview and the policies it rendered for the workloads whose rendered content differs from
/// the content their agent applied.
struct Preview {
    render: DraftRender,
    report: RunReport,
    proposed: BTreeMap<WorkloadId, WorkloadPolicy>,
}

/// Applies the draft and renders in a transaction that is rolled back.
async fn preview(pool: &PgPool, actor: &str, name: &str, counts: &CountBounds) -> Result<Preview, Error> {
    let mut tx = pool.begin().await?;
    let row = sqlx::query("SELECT id, version FROM drafts WHERE name = $1")
        .bind(name)
        .fetch_optional(&mut *tx)
        .await?
        .ok_or_else(|| Error::NotFound { what: "draft", name: name.to_owned() })?;
    let (id, version): (Uuid, i64) = (row.get(0), row.get(1));
    let changes = stored(&mut tx, id).await?;
    let promotions = apply_all(&mut tx, actor, name, &changes, counts, Judged::Noted).await?;
    let rendering = publish::publish_rendering(&mut tx, Overflow::Refuse).await?;
    let report = super::commit::judge(&mut tx, &rendering).await?;
    let workloads = rendered_changes(&mut tx, &rendering.changed).await?;
    let applied = applied_digests(&mut tx).await?;
    let mut digests: BTreeMap<usize, Vec<u8>> = BTreeMap::new();
    let mut proposed = BTreeMap::new();
    for (w, content) in rendering.rendered.shares() {
        let policy = &rendering.rendered.policies()[content];
        let digest = digests.entry(content).or_insert_with(|| store::Content::of(policy).digest);
        if applied.get(&w) != Some(digest) {
            proposed.insert(w, policy.clone());
        }
    }
    tx.rollback().await?;
    let mut blockers: Vec<String> = promotions
        .iter()
        .filter(|p| p.to_mode == Mode::Enforcement.name())
        .filter_map(|p| {
            let outcome = p.verdict.as_ref().and_then(|v| v.get("outcome")).and_then(|o| o.as_str());
            (outcome != Some(Outcome::Safe.name())).then(|| {
                let outcome = outcome.unwrap_or("unknown");
                format!("mode change of {} to enforcement: the verdict is {outcome}, not SAFE", p.scope)
            })
        })
        .collect();
    let failing_tests: Vec<TestResult> = report.results.iter().filter(|r| !r.passed).cloned().collect();
    if !failing_tests.is_empty() {
        blockers.push(format!("{} policy test(s) fail", failing_tests.len()));
    }
    Ok(Preview {
        render: DraftRender {
            draft: name.to_owned(),
            draft_version: version,
            workloads,
            blockers,
            failing_tests,
        },
        report,
        proposed,
    })
}

/// The digest of the content each live workload's agent applied (those that applied one).
async fn applied_digests(conn: &mut PgConnection) -> Result<BTreeMap<WorkloadId, Vec<u8>>, Error> {
    let rows = sqlx::query(
        "SELECT w.id, h.digest FROM workloads w
         JOIN workload_policy_history h ON h.workload_id = w.id AND h.version = w.applied_version
         WHERE w.retired_at IS NULL AND w.denied_at IS NULL",
    )
    .fetch_all(&mut *conn)
    .await?;
    rows.into_iter()
        .map(|r| {
            let uuid: Uuid = r.get(0);
            let id = WorkloadId::from_uuid(uuid)
                .ok_or_else(|| Error::Corrupt { what: "workload id", detail: uuid.to_string() })?;
            Ok((id, r.get(1)))
        })
        .collect()
}

/// For each workload whose version advanced in this transaction: the delta from its previous
/// persisted version, as the stream encodes it.
async fn rendered_changes(
    conn: &mut PgConnection,
    changed: &[Changed],
) -> Result<Vec<RenderedChange>, Error> {
    let mut wanted: Vec<(WorkloadId, u64)> = changed.iter().map(|c| (c.workload, c.version)).collect();
    wanted.extend(changed.iter().filter(|c| c.version > 1).map(|c| (c.workload, c.version - 1)));
    let policies = store::policies_at(conn, &wanted).await?;
    let missing = |w: WorkloadId, v: u64| Error::Corrupt {
        what: "rendered policy",
        detail: format!("workload {w} version {v} is not stored"),
    };
    changed
        .iter()
        .map(|c| {
            let new = policies.get(&(c.workload, c.version)).ok_or_else(|| missing(c.workload, c.version))?;
            let (from_version, delta_changes, delta) = match c.version {
                1 => (0, 0, String::new()),
                v => {
                    let old = policies.get(&(c.workload, v - 1)).ok_or_else(|| missing(c.workload, v - 1))?;
                    let d = diff(old, new);
                    (v - 1, d.changes.len(), delta_bytes(&d))
                }
            };
            Ok(RenderedChange {
                workload: c.workload,
                from_version,
                to_version: c.version,
                mode: new.mode().to_string(),
                delta_changes,
                delta,
                digest: crate::identity::ca::hex(
                    ring::digest::digest(&ring::digest::SHA256, &new.canonical_bytes()).as_ref(),
                ),
            })
        })
        .collect()
}

/// A delta's bytes as the sync stream sends them, base64.
pub fn delta_bytes(delta: &innerwall_wire::policy::PolicyDelta) -> String {
    use base64::Engine as _;
    let bytes = innerwall_wire::proto::PolicyDelta::from(delta).encode_to_vec();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// The draft rendered without committing: per workload, the delta it would receive and the
/// version the commit would persist; what would refuse the commit now. Writes nothing.
pub async fn render(
    pool: &PgPool,
    actor: &str,
    name: &str,
    counts: &CountBounds,
) -> Result<DraftRender, Error> {
    Ok(preview(pool, actor, name, counts).await?.render)
}

/// The policy tests judged on the estate as the draft would render it. Writes nothing.
pub async fn run_tests(
    pool: &PgPool,
    actor: &str,
    name: &str,
    counts: &CountBounds,
) -> Result<RunReport, Error> {
    Ok(preview(pool, actor, name, counts).await?.report)
}

/// The draft's impact on the flows recorded over `range`: the workloads whose rendered policy
/// differs from the one their agent applied, replayed through both (`foresight::impact`). The
/// replay reads flows after the render's transaction has ended (it holds no render lock).
pub async fn impact(
    pool: &PgPool,
    actor: &str,
    name: &str,
    counts: &CountBounds,
    range: Range,
    top: usize,
) -> Result<(DraftRender, Impact), Error> {
    let preview = preview(pool, actor, name, counts).await?;
    let impact = impact::impact(&mut *pool.acquire().await?, &preview.proposed, range, top).await?;
    Ok((preview.render, impact))
}

/// What a draft's commit did.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DraftCommitted {
    pub draft: String,
    pub changes: usize,
    /// The promotion records of its mode changes.
    pub promotions: Vec<Uuid>,
}

/// Commits the draft read at version `expected`: every change in one checked transaction (the
/// policy tests judge it), with the same render as any commit; refused, writing nothing, if any
/// object moved since its change was added (naming every one), if a mode change's count or
/// verdict refuses, or if a test fails. The draft is kept, marked committed.
pub async fn commit(
    pool: &PgPool,
    actor: &str,
    name: &str,
    expected: i64,
    counts: &CountBounds,
) -> Result<Committed<DraftCommitted>, Error> {
    super::commit(pool, actor, "draft.commit", name, async |c| {
        let (id, current) = lock(c, name).await?;
        if current != expected {
            return Err(stale(name, expected, current));
        }
        let changes = stored(c, id).await?;
        if changes.is_empty() {
            return Err(Error::Invalid(format!("draft {name:?} holds no change: nothing to commit")));
        }
        let promotions = apply_all(c, actor, name, &changes, counts, Judged::Refused).await?;
        sqlx::query("UPDATE drafts SET committed_at = now(), committed_by = $2 WHERE id = $1")
            .bind(id)
            .bind(actor)
            .execute(&mut *c)
            .await?;
        let detail = serde_json::json!({
            "version": current,
            "objects": changes.iter().map(|c| c.object.as_str()).collect::<Vec<_>>(),
            "changes": changes.iter().map(|c| serde_json::json!({"object": c.object, "base": c.base, "change": c.spec})).collect::<Vec<_>>(),
            "promotions": promotions.iter().map(promote::audit_detail).collect::<Vec<_>>(),
        });
        let value =
            DraftCommitted { draft: name.to_owned(), changes: changes.len(), promotions: promotions.iter().map(|p| p.id).collect() };
        Ok((value, detail))
    })
    .await
}
