//! The publish transaction (POL-4, POL-5, SYNC-7): under the render lock, render every live
//! workload, diff each against its persisted policy with the shared `wire` diff, advance the
//! version only on a non-empty diff, persist, and announce on the notice channel — delivered by
//! Postgres only when the caller's transaction commits.

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::{Version, WorkloadPolicy, diff};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::audit;
use crate::copy;
use crate::error::Error;
use crate::notice::{self, Notice};
use crate::policy::addresses::{self, Standing};
use crate::policy::inputs::{self, Inputs};
use crate::policy::model::{AuthoredModel, RegisteredWorkload, Ruleset};
pub use crate::policy::narrow::Touched;
use crate::policy::render::{Bound, Origin, Oversize, Rendered, oversize, render_indexed, render_only};
use crate::policy::source::{Digest, Sources, source_digest};
use crate::policy::store;
use crate::policy::{narrow, off_thread};

/// Key of the transaction-scoped advisory lock every render takes (ASCII "iw-rendr").
pub const RENDER_LOCK_KEY: i64 = 0x6977_2d72_656e_6472;

/// A workload whose persisted policy advanced in this render.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Changed {
    pub workload: WorkloadId,
    pub version: Version,
}

/// The next persisted policy of one workload, or `None` when nothing it can see changed.
/// The first render always persists version 1, even when empty.
pub fn next_version(persisted: Option<&WorkloadPolicy>, rendered: WorkloadPolicy) -> Option<WorkloadPolicy> {
    match persisted {
        None => Some(rendered.with_version(1)),
        Some(old) => {
            let same_base = rendered.with_version(old.version());
            let delta = diff(old, &same_base);
            (!delta.changes.is_empty()).then(|| same_base.with_version(old.version() + 1))
        }
    }
}

/// Whether `rendered` really differs from a persisted policy whose content has another digest
/// and was stored before contents were shared (with the version inside it): the decoded policies
/// decide. Bytes that are not a policy are an error, not a silent new version.
fn really_changed(persisted: &store::Persisted, rendered: &WorkloadPolicy) -> Result<bool, Error> {
    Ok(next_version(Some(&persisted.decode()?), rendered.clone()).is_some())
}

/// The rendered-policy bound of this process's renders: `serve` and the local CLI set it from
/// their flags before they render; until then it is [`Bound::default`].
static BOUND: std::sync::RwLock<Option<Bound>> = std::sync::RwLock::new(None);

/// Sets the bound every later render of this process checks.
pub fn set_bound(bound: Bound) {
    *BOUND.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(bound);
}

/// The bound renders check now.
pub fn bound() -> Bound {
    BOUND.read().unwrap_or_else(std::sync::PoisonError::into_inner).unwrap_or_default()
}

/// What a render does with a workload whose new policy is over the [`Bound`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overflow {
    /// Refuse the whole change, naming the workload, the rule and the bound (an operator's
    /// change: nothing is written).
    Refuse,
    /// Keep that workload at its last good version, marked held with why (it reads DEGRADED);
    /// the rest of the estate renders. For renders nobody can take back: start-up and repair
    /// renders, an agent's inventory, enrollment — an estate accepted earlier (before the
    /// bound was lowered) never makes them fail.
    Hold,
}

/// Takes the render lock for the rest of the caller's transaction (again is fine: it stacks),
/// waiting at most the connection's lock timeout. Whatever the transaction reads after it, no
/// render or authored change commits in between.
pub async fn lock_renders(conn: &mut PgConnection) -> Result<(), Error> {
    sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(RENDER_LOCK_KEY).execute(&mut *conn).await.map_err(
        |e| match e.as_database_error().and_then(|d| d.code()).as_deref() {
            // lock_not_available: the connection's lock_timeout passed (postgres::Timeouts).
            Some("55P03") => Error::Busy(crate::error::RENDER_LOCK_HELD.into()),
            _ => Error::Database(e),
        },
    )?;
    Ok(())
}

/// Renders and persists inside the caller's transaction. Returns the workloads whose version
/// advanced, in id order. The caller commits (which delivers the notifications) or rolls back
/// (which delivers none).
pub async fn publish(conn: &mut PgConnection) -> Result<Vec<Changed>, Error> {
    publish_with(conn, Overflow::Refuse).await
}

/// [`publish`], choosing what a policy over the bound does.
pub async fn publish_with(conn: &mut PgConnection, overflow: Overflow) -> Result<Vec<Changed>, Error> {
    Ok(publish_rendering(conn, overflow).await?.changed)
}

/// What one render saw and produced, kept for checks that judge the rendered estate inside the
/// same transaction (`foresight`'s policy tests): the authored model, the registry with the
/// addresses accepted as rendered, every workload's rendered policy (only the workloads the
/// change could touch when `narrowed`), and the versions advanced.
#[derive(Debug)]
pub struct Rendering {
    pub model: Arc<AuthoredModel>,
    pub registry: Arc<Vec<RegisteredWorkload>>,
    pub rendered: Rendered,
    pub changed: Vec<Changed>,
    /// Rendered narrowed (POL-7): `rendered` holds the workloads the change could touch, and
    /// every other kept its policy.
    pub narrowed: bool,
    /// How the render came by the model and registry (`policy::inputs`).
    pub inputs: inputs::Outcome,
}

/// [`publish_with`], keeping the pieces of the render ([`Rendering`]).
pub async fn publish_rendering(conn: &mut PgConnection, overflow: Overflow) -> Result<Rendering, Error> {
    publish_touched(conn, overflow, &[]).await
}

/// [`publish_rendering`] of a change that touched only `touched` (none: render everything). It
/// renders everything anyway when that is the only honest answer: an address standing moved in
/// this render, a touched workload is not live, or policy tests exist (they judge the whole
/// rendered estate).
pub async fn publish_touched(
    conn: &mut PgConnection,
    overflow: Overflow,
    touched: &[Touched],
) -> Result<Rendering, Error> {
    lock_renders(conn).await?;
    let started = std::time::Instant::now();
    let rendering = render_and_persist(conn, overflow, touched).await?;
    crate::metrics::observe_render(started.elapsed(), rendering.changed.len());
    Ok(rendering)
}

/// The workloads a render of `touched` must render again, or `None` for all of them.
async fn narrowing(
    conn: &mut PgConnection,
    inputs: &Inputs,
    rulesets_before: &BTreeMap<String, Option<Ruleset>>,
    touched: &[Touched],
) -> Result<Option<BTreeSet<WorkloadId>>, Error> {
    let (model, registry) = (&*inputs.model, &*inputs.accepted);
    if touched.is_empty() {
        return Ok(None);
    }
    // The accepted registry is in id order.
    let find = |id: &WorkloadId| registry.binary_search_by_key(id, |w| w.id).ok().map(|at| &registry[at]);
    // Policy tests (`foresight`) judge every workload's rendered policy.
    let tests: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM policy_test_sets)").fetch_one(&mut *conn).await?;
    if tests {
        return Ok(None);
    }
    let mut before = Vec::with_capacity(touched.len());
    let mut catalog = Vec::new();
    for touched in touched {
        let id = match touched {
            Touched::Labels(id) => id,
            // New: it was nowhere before.
            Touched::Enrolled(id) => {
                let after = find(id);
                catalog.push(narrow::Change::Workload { before: None, after });
                continue;
            }
            // Its rules before: only from the inputs kept from before the change.
            Touched::Ruleset(name) => {
                let Some(before) = rulesets_before.get(name) else { return Ok(None) };
                let after = model.rulesets.iter().find(|r| &r.name == name);
                catalog.push(narrow::Change::Ruleset { before: before.as_ref(), after });
                continue;
            }
            // A staged ruleset names groups and services by name and is rendered once they
            // resolve: a new one may bring it in. Rare; render everything.
            Touched::AddressGroup(_) | Touched::Service(_) if !model.staged.is_empty() => return Ok(None),
            // Gone, nothing names it (deleting one that rules name is refused); new, nothing
            // names it yet.
            Touched::AddressGroup(name) => {
                catalog.extend(
                    model
                        .address_groups
                        .values()
                        .filter(|g| &g.name == name)
                        .map(|g| narrow::Change::AddressGroup(g.id)),
                );
                continue;
            }
            Touched::Service(name) => {
                catalog.extend(
                    model
                        .services
                        .values()
                        .filter(|s| &s.name == name)
                        .map(|s| narrow::Change::Service(s.id)),
                );
                continue;
            }
        };
        let Some(now) = find(id) else { return Ok(None) };
        // The row this transaction closed, if the edit changed anything (`now()` is the
        // transaction's time).
        let was: Option<serde_json::Value> = sqlx::query_scalar(
            "SELECT labels FROM workload_label_history WHERE workload_id = $1 AND valid_to = now()",
        )
        .bind(id.uuid())
        .fetch_optional(&mut *conn)
        .await?;
        let labels = match was {
            None => now.labels.clone(),
            Some(json) => store::labels_from_json(json)?,
        };
        before.push(RegisteredWorkload { labels, ..now.clone() });
    }
    let changes: Vec<narrow::Change<'_>> = before
        .iter()
        .map(|was| narrow::Change::Workload {
            before: Some(was),
            after: registry.iter().find(|w| w.id == was.id),
        })
        .chain(catalog)
        .collect();
    Ok(Some(narrow::affected_indexed(model, registry, &inputs.labels, &inputs.consumers, &changes)))
}

/// `publish` under the render lock: of every workload, or of those `touched` can touch.
async fn render_and_persist(
    conn: &mut PgConnection,
    overflow: Overflow,
    touched: &[Touched],
) -> Result<Rendering, Error> {
    let (mut inputs, outcome, rulesets_before) = match inputs::kept(conn, touched).await? {
        Some(reused) => (reused.inputs, reused.outcome, reused.rulesets_before),
        None => (inputs::load(conn).await?, inputs::Outcome::Loaded, BTreeMap::new()),
    };
    crate::metrics::count_render_inputs(outcome);
    let model = Arc::clone(&inputs.model);
    let registry = Arc::clone(&inputs.accepted);
    // Judged on a load, which stores the standings that moved, and when workloads enrolled (their
    // claims are new): a standing that moved for any other workload renders everything.
    let enrolled: BTreeSet<WorkloadId> =
        touched.iter().filter_map(|t| if let Touched::Enrolled(id) = t { Some(*id) } else { None }).collect();
    let judged = (matches!(outcome, inputs::Outcome::Loaded) || !enrolled.is_empty()).then(|| judge(&inputs));
    let moved: BTreeSet<WorkloadId> = judged.iter().flatten().map(|&(w, _, _)| w).collect();
    let standings_moved = match outcome {
        inputs::Outcome::Loaded => !moved.is_empty(),
        _ => !moved.is_subset(&enrolled),
    };
    let only = match standings_moved {
        true => None,
        false => narrowing(conn, &inputs, &rulesets_before, touched).await?,
    };
    // The render is CPU, Postgres's writes are not: it runs on another thread meanwhile.
    let rendering = {
        let (model, registry, labels, only) =
            (Arc::clone(&model), Arc::clone(&registry), Arc::clone(&inputs.labels), only.clone());
        off_thread(move || {
            let rendered = match &only {
                Some(only) => render_only(&model, &registry, &labels, only)?,
                None => render_indexed(&model, &registry, &labels)?,
            };
            let contents = contents_of(rendered.policies());
            Ok::<_, Error>((rendered, contents))
        })
    };
    if let Some(judged) = judged {
        store_judgement(conn, &mut inputs, judged).await?;
    }
    let latest = store::load_latest_of(conn, only.as_ref()).await?;
    let (mut rendered, contents) = rendering.await?;
    let mut next = next_versions(conn, &rendered, &contents, &latest).await?;
    let held = over_bound(&model, &rendered, &contents, &mut next, bound(), overflow)?;
    save_held(conn, &held, only.as_ref()).await?;
    let mut changed = Vec::new();
    if !next.is_empty() {
        // Each new version's source is worked out while its latest row is written.
        let sourcing = {
            let model = Arc::clone(&model);
            let wanted: Vec<usize> = next.iter().map(|n| n.content).collect();
            off_thread(move || {
                let sourced = sources_of(&model, &rendered, &wanted);
                (rendered, sourced)
            })
        };
        persist_latest(conn, &next, &contents).await?;
        let sourced;
        (rendered, sourced) = sourcing.await;
        let sources = store_sources(conn, &next, sourced?).await?;
        let staged: Vec<Option<&str>> =
            next.iter().map(|n| rendered.policies()[n.content].staged().map(|s| s.set())).collect();
        persist_history(conn, &next, &contents, &sources, &staged).await?;
        let notices: Vec<Notice> = next.iter().map(|n| Notice::Policy(n.workload, n.version)).collect();
        notice::publish(conn, &notices).await?;
        changed = next.iter().map(|n| Changed { workload: n.workload, version: n.version }).collect();
    }
    inputs::keep(conn, &inputs).await?;
    Ok(Rendering { model, registry, rendered, changed, narrowed: only.is_some(), inputs: outcome })
}

/// Checks every policy about to be persisted against `bound`. Refusing, the first workload over
/// it (in id order) is the error; holding, those workloads leave `next` and are returned with
/// why. Only new versions are checked: a policy persisted before the bound was lowered stands.
fn over_bound(
    model: &AuthoredModel,
    rendered: &Rendered,
    contents: &[store::Content],
    next: &mut Vec<Next>,
    bound: Bound,
    overflow: Overflow,
) -> Result<Vec<(WorkloadId, String)>, Error> {
    let mut checked: BTreeMap<usize, Option<Oversize>> = BTreeMap::new();
    let mut held = Vec::new();
    let mut kept = Vec::with_capacity(next.len());
    for n in next.drain(..) {
        let over = checked.entry(n.content).or_insert_with(|| {
            oversize(&rendered.policies()[n.content], contents[n.content].bytes.len(), bound)
        });
        let Some(over) = over else {
            kept.push(n);
            continue;
        };
        let sharing = rendered.shares().filter(|(w, c)| *c == n.content && *w != n.workload).count();
        let what = describe_oversize(model, n.workload, sharing, over, bound);
        match overflow {
            Overflow::Refuse => return Err(Error::Invalid(format!("{what}; nothing was changed"))),
            Overflow::Hold => {
                tracing::warn!(workload = %n.workload, "held at its last good version: {what}");
                held.push((n.workload, format!("held at its last good version: {what}")));
            }
        }
    }
    *next = kept;
    Ok(held)
}

/// Names the workload, its size, the bound and the largest rule (by ruleset and rule name).
fn describe_oversize(
    model: &AuthoredModel,
    workload: WorkloadId,
    sharing: usize,
    over: &Oversize,
    bound: Bound,
) -> String {
    let others = match sharing {
        0 => String::new(),
        1 => " (and 1 other workload with the same policy)".to_owned(),
        n => format!(" (and {n} other workloads with the same policy)"),
    };
    let rule = over.largest_rule.map_or_else(String::new, |(id, entries)| {
        let named = model.rulesets.iter().find_map(|rs| {
            rs.rules
                .iter()
                .find(|r| r.id == id)
                .map(|r| format!("rule {:?} of ruleset {:?}", r.name, rs.name))
        });
        format!(
            "; its largest rule is {} ({id}) with {entries} entries",
            named.unwrap_or_else(|| "rule".into())
        )
    });
    format!(
        "the rendered policy of workload {workload}{others} would be {} entries and {} bytes, over the \
         rendered-policy bound of {} entries (--max-rendered-entries) and {} bytes (--max-rendered-bytes){rule}: \
         narrow that rule's peers or services, or raise the bound",
        over.entries, over.bytes, bound.entries, bound.bytes
    )
}

/// Marks the workloads held in this render (their reason) and clears every other hold.
async fn save_held(
    conn: &mut PgConnection,
    held: &[(WorkloadId, String)],
    rendered: Option<&BTreeSet<WorkloadId>>,
) -> Result<(), Error> {
    let ids: Vec<Uuid> = held.iter().map(|(w, _)| w.uuid()).collect();
    let reasons: Vec<&str> = held.iter().map(|(_, r)| r.as_str()).collect();
    // Only a workload rendered now can stop being held.
    let scope: Option<Vec<Uuid>> = rendered.map(|ids| ids.iter().map(WorkloadId::uuid).collect());
    sqlx::query(
        "UPDATE workloads SET policy_held = NULL
         WHERE policy_held IS NOT NULL AND id <> ALL($1) AND ($2::uuid[] IS NULL OR id = ANY($2))",
    )
    .bind(&ids)
    .bind(&scope)
    .execute(&mut *conn)
    .await?;
    if !held.is_empty() {
        sqlx::query(
            "UPDATE workloads w SET policy_held = t.r FROM unnest($1::uuid[], $2::text[]) AS t (id, r)
             WHERE w.id = t.id AND w.policy_held IS DISTINCT FROM t.r",
        )
        .bind(&ids)
        .bind(&reasons)
        .execute(&mut *conn)
        .await?;
    }
    Ok(())
}

/// Each policy's [`store::Content`], in order. Encoding and hashing are most of the CPU a render
/// of many distinct policies spends (10,000 policies are 55 MB): spread over the cores.
fn contents_of(policies: &[WorkloadPolicy]) -> Vec<store::Content> {
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    if cores == 1 || policies.len() < 64 {
        return policies.iter().map(store::Content::of).collect();
    }
    std::thread::scope(|scope| {
        let parts: Vec<_> = policies
            .chunks(policies.len().div_ceil(cores))
            .map(|part| scope.spawn(|| part.iter().map(store::Content::of).collect::<Vec<_>>()))
            .collect();
        parts.into_iter().flat_map(|part| part.join().expect("encoding a policy does not panic")).collect()
    })
}

/// A workload whose persisted policy advances: to `version`, with content `contents[content]`.
struct Next {
    workload: WorkloadId,
    version: Version,
    content: usize,
}

/// The workloads whose policy really changed, in id order. Equal digests are equal policies, and
/// so are different digests different policies, but for contents stored with their version inside
/// (before contents were shared): those alone are read and decoded, once per pair of stored and
/// rendered contents (a label change moves groups of workloads that share both).
async fn next_versions(
    conn: &mut PgConnection,
    rendered: &Rendered,
    contents: &[store::Content],
    latest: &BTreeMap<WorkloadId, store::Latest>,
) -> Result<Vec<Next>, Error> {
    let mut next = Vec::new();
    let mut differ = Vec::new();
    for (workload, content) in rendered.shares() {
        match latest.get(&workload) {
            None => next.push(Next { workload, version: 1, content }),
            Some(held) if held.digest == contents[content].digest => {}
            Some(held) => differ.push((workload, held, content)),
        }
    }
    if differ.is_empty() {
        return Ok(next);
    }
    let mut wanted: Vec<Vec<u8>> = differ.iter().map(|(_, held, _)| held.digest.clone()).collect();
    wanted.sort_unstable();
    wanted.dedup();
    let versioned = store::load_versioned_contents(conn, &wanted).await?;
    let mut decided: BTreeMap<(&[u8], usize), bool> = BTreeMap::new();
    for (workload, held, content) in differ {
        let Some(bytes) = versioned.get(&held.digest) else {
            next.push(Next { workload, version: held.version + 1, content });
            continue;
        };
        let changed = match decided.entry((&held.digest, content)) {
            Entry::Occupied(e) => *e.get(),
            Entry::Vacant(e) => {
                let persisted = store::Persisted { version: held.version, bytes: bytes.clone() };
                *e.insert(really_changed(&persisted, &rendered.policies()[content])?)
            }
        };
        if changed {
            next.push(Next { workload, version: held.version + 1, content });
        }
    }
    next.sort_unstable_by_key(|n| n.workload);
    Ok(next)
}

/// Writes the contents `next` refers to (each once; a stored one stays) and each workload's
/// latest row.
async fn persist_latest(
    conn: &mut PgConnection,
    next: &[Next],
    contents: &[store::Content],
) -> Result<(), Error> {
    // Groups that render equal policies share a digest: one row; a stored one stays. Only a
    // publish writes contents, under the render lock: none can appear between the two statements.
    let mut new: BTreeMap<&[u8], &[u8]> = next
        .iter()
        .map(|n| (contents[n.content].digest.as_slice(), contents[n.content].bytes.as_slice()))
        .collect();
    let wanted: Vec<&[u8]> = new.keys().copied().collect();
    let stored: Vec<Vec<u8>> =
        sqlx::query_scalar("SELECT digest FROM policy_contents WHERE digest = ANY($1)")
            .bind(&wanted)
            .fetch_all(&mut *conn)
            .await?;
    for digest in &stored {
        new.remove(digest.as_slice());
    }
    if !new.is_empty() {
        let statement = "COPY policy_contents (digest, policy) FROM STDIN (FORMAT binary)";
        copy_by_digest(conn, statement, new.iter().map(|(d, b)| (*d, *b))).await?;
    }
    let ids: Vec<Uuid> = next.iter().map(|n| n.workload.uuid()).collect();
    let versions: Vec<i64> = next.iter().map(|n| n.version as i64).collect();
    let digests: Vec<&[u8]> = next.iter().map(|n| contents[n.content].digest.as_slice()).collect();
    sqlx::query(
        "INSERT INTO workload_policies (workload_id, version, digest, rendered_at)
         SELECT w, v, d, now() FROM unnest($1::uuid[], $2::bigint[], $3::bytea[]) AS t (w, v, d)
         ON CONFLICT (workload_id) DO UPDATE
         SET version = excluded.version, digest = excluded.digest, rendered_at = excluded.rendered_at",
    )
    .bind(&ids)
    .bind(&versions)
    .bind(&digests)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Writes each workload's history row of `next` (with its source and its staged set, in `next`'s
/// order), after [`persist_latest`] in the same transaction.
async fn persist_history(
    conn: &mut PgConnection,
    next: &[Next],
    contents: &[store::Content],
    sources: &[Vec<u8>],
    staged: &[Option<&str>],
) -> Result<(), Error> {
    let ids: Vec<Uuid> = next.iter().map(|n| n.workload.uuid()).collect();
    let versions: Vec<i64> = next.iter().map(|n| n.version as i64).collect();
    let digests: Vec<&[u8]> = next.iter().map(|n| contents[n.content].digest.as_slice()).collect();
    // now() is the transaction's time: the same `rendered_at` as the latest rows'.
    sqlx::query(
        "INSERT INTO workload_policy_history (workload_id, version, digest, rendered_at, source_digest, staged_set)
         SELECT w, v, d, now(), s, g
         FROM unnest($1::uuid[], $2::bigint[], $3::bytea[], $4::bytea[], $5::text[]) AS t (w, v, d, s, g)",
    )
    .bind(&ids)
    .bind(&versions)
    .bind(&digests)
    .bind(sources)
    .bind(staged)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// The authored sources of a render's new versions (`policy::source`), worked out without
/// storing them: each content's source digest, the sources, and the parts they list.
struct Sourced {
    /// Each content's source digest, by its index in the render.
    digests: BTreeMap<usize, Vec<u8>>,
    /// Each source rendered from rulesets: digest → the digests of its parts.
    new: BTreeMap<Vec<u8>, Vec<u8>>,
    /// Every part those sources list: digest → canonical bytes.
    parts: BTreeMap<Digest, Vec<u8>>,
}

/// The sources of the contents `wanted` (indices into `rendered`'s policies). A pinned
/// workload's is its pin's.
fn sources_of(model: &AuthoredModel, rendered: &Rendered, wanted: &[usize]) -> Result<Sourced, Error> {
    let mut sources = Sources::new(model);
    let mut digests: BTreeMap<usize, Vec<u8>> = BTreeMap::new();
    let mut new: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
    for &content in wanted {
        if digests.contains_key(&content) {
            continue;
        }
        let digest = match rendered.origin(content) {
            Origin::Pinned(w) => {
                model.pinned.get(w).map(|p| p.digest.clone()).ok_or_else(|| Error::Corrupt {
                    what: "rollback pin",
                    detail: format!("workload {w} rendered from a pin it does not have"),
                })?
            }
            Origin::Rulesets(at) => {
                let parts = sources.source(at);
                let digest = source_digest(&parts).to_vec();
                new.insert(digest.clone(), parts);
                digest
            }
        };
        digests.insert(content, digest);
    }
    Ok(Sourced { digests, new, parts: sources.parts })
}

/// Stores the sources of `next`'s new versions (new parts, then new sources) and returns each
/// one's digest, in `next`'s order, for its history row.
async fn store_sources(
    conn: &mut PgConnection,
    next: &[Next],
    sourced: Sourced,
) -> Result<Vec<Vec<u8>>, Error> {
    let Sourced { digests, mut new, mut parts } = sourced;
    let out = next.iter().map(|n| digests[&n.content].clone()).collect();
    if new.is_empty() {
        return Ok(out);
    }
    // A stored source's parts are stored: only the others are sent. Most renders store none (a
    // label change or a new address changes peers, not what the rulesets say). Sources are
    // written and deleted only under the render lock: none can come or go before the inserts.
    let wanted: Vec<&[u8]> = new.keys().map(Vec::as_slice).collect();
    let stored: Vec<Vec<u8>> = sqlx::query_scalar("SELECT digest FROM policy_sources WHERE digest = ANY($1)")
        .bind(&wanted)
        .fetch_all(&mut *conn)
        .await?;
    for digest in &stored {
        new.remove(digest);
    }
    if new.is_empty() {
        return Ok(out);
    }
    let named: BTreeSet<&[u8]> = new.values().flat_map(|list| list.chunks(32)).collect();
    parts.retain(|digest, _| named.contains(digest.as_slice()));
    let (keys, parts): (Vec<Vec<u8>>, Vec<String>) = parts
        .into_iter()
        .map(|(d, bytes)| (d.to_vec(), String::from_utf8(bytes).expect("JSON is UTF-8")))
        .unzip();
    sqlx::query(
        "INSERT INTO policy_source_parts (digest, part)
         SELECT d, p::jsonb FROM unnest($1::bytea[], $2::text[]) AS t (d, p)
         WHERE NOT EXISTS (SELECT 1 FROM policy_source_parts s WHERE s.digest = t.d)
         ON CONFLICT (digest) DO NOTHING",
    )
    .bind(&keys)
    .bind(&parts)
    .execute(&mut *conn)
    .await?;
    // None of them is stored (read above, under the lock), and `new` holds each once: streamed
    // in, as the contents are (a first render of 10,000 distinct policies writes 10,000 sources).
    let statement = "COPY policy_sources (digest, parts) FROM STDIN (FORMAT binary)";
    copy_by_digest(conn, statement, new.iter().map(|(d, list)| (d.as_slice(), list.as_slice()))).await?;
    Ok(out)
}

/// Streams rows of a digest and its bytes in by binary `COPY` (`statement` names the table and
/// its two `bytea` columns): content-addressed rows none of which is stored yet.
async fn copy_by_digest<'a>(
    conn: &mut PgConnection,
    statement: &'static str,
    rows: impl Iterator<Item = (&'a [u8], &'a [u8])> + Clone,
) -> Result<(), Error> {
    let mut copy = copy::Rows::with_capacity(rows.clone().map(|(d, b)| 10 + d.len() + b.len()).sum());
    for (digest, bytes) in rows {
        copy.row(2);
        copy.bytea(digest);
        copy.bytea(bytes);
    }
    copy::copy_in(conn, statement, copy).await
}

/// Address trust, judged and not yet stored: the standings that differ from those stored.
fn judge(inputs: &Inputs) -> Vec<(WorkloadId, IpAddr, Standing)> {
    addresses::changes(&inputs.registry.stored, &inputs.standings)
}

/// Stores the standings that moved (auditing each workload whose addresses were refused, came
/// into conflict, or were accepted again) and leaves `inputs` as stored after it: the
/// standings, and the workloads with only their accepted addresses, to render.
async fn store_judgement(
    conn: &mut PgConnection,
    inputs: &mut Inputs,
    changes: Vec<(WorkloadId, IpAddr, Standing)>,
) -> Result<(), Error> {
    if changes.is_empty() {
        return Ok(());
    }
    let registry = &inputs.registry;
    store::save_standings(conn, &changes).await?;
    // A new address that is accepted is recorded by the change that reported it (an enrollment's
    // are all such, and then the estate's conflicts are not looked for).
    let notable: Vec<(WorkloadId, IpAddr, Standing)> = changes
        .iter()
        .copied()
        .filter(|&(w, address, standing)| {
            standing != Standing::Accepted || registry.stored.get(&(w, address)).copied().flatten().is_some()
        })
        .collect();
    let conflicts = match notable.is_empty() {
        true => BTreeMap::new(),
        false => addresses::conflicts(&inputs.standings),
    };
    let mut noteworthy: BTreeMap<WorkloadId, Vec<serde_json::Value>> = BTreeMap::new();
    for (w, address, standing) in notable {
        let mut entry = serde_json::json!({"address": address.to_string(), "standing": standing.name()});
        if let Some(others) = conflicts.get(&address) {
            let others: Vec<String> = others.iter().filter(|o| **o != w).map(ToString::to_string).collect();
            entry["also_claimed_by"] = serde_json::json!(others);
        }
        noteworthy.entry(w).or_default().push(entry);
    }
    for (w, entries) in noteworthy {
        let subject = w.to_string();
        let record = audit::Record::new("control-plane", "workload.address-standing", &subject)
            .detail(serde_json::json!({"addresses": entries}));
        audit::write(conn, &record).await?;
    }
    // The workloads rendered are those of the standings just judged (`accepted_only`).
    let registry = Arc::make_mut(&mut inputs.registry);
    for (w, address, standing) in changes {
        registry.stored.insert((w, address), Some(standing));
    }
    Ok(())
}

/// The registry as the next render sees it (each workload with only its accepted addresses),
/// read without storing anything: for what-if renders inside a change (`safety::staged`).
pub async fn registry_as_rendered(conn: &mut PgConnection) -> Result<Vec<RegisteredWorkload>, Error> {
    let registry = store::load_registry(conn).await?;
    Ok(inputs::accepted_only(&registry))
}

#[cfg(test)]
mod tests {
    use innerwall_wire::policy::Mode;
    use innerwall_wire::testing::policy;

    use super::*;

    #[test]
    fn first_render_is_version_one_even_when_empty() {
        assert_eq!(
            next_version(None, policy(0, Mode::Visibility, &[])),
            Some(policy(1, Mode::Visibility, &[]))
        );
    }

    #[test]
    fn version_advances_by_one_only_on_a_real_change() {
        let held = policy(7, Mode::Enforcement, &[22]);
        assert_eq!(next_version(Some(&held), policy(0, Mode::Enforcement, &[22])), None);
        assert_eq!(
            next_version(Some(&held), policy(0, Mode::Enforcement, &[22, 443])),
            Some(policy(8, Mode::Enforcement, &[22, 443]))
        );
        assert_eq!(
            next_version(Some(&held), policy(0, Mode::Simulation, &[22])),
            Some(policy(8, Mode::Simulation, &[22]))
        );
    }

    /// Against stored content: a rendered policy equal to it, whether the content was stored
    /// without its version (as now) or with it (before contents were shared), is no change;
    /// bytes that are not a policy are an error, not a silent new version.
    #[test]
    fn stored_content_changes_only_when_the_decoded_policy_does() {
        let held = policy(7, Mode::Enforcement, &[22]);
        for bytes in [store::Content::of(&held).bytes, held.canonical_bytes()] {
            let stored = store::Persisted { version: 7, bytes };
            assert_eq!(stored.decode().unwrap(), held);
            assert!(!really_changed(&stored, &policy(0, Mode::Enforcement, &[22])).unwrap());
            for next in [policy(0, Mode::Enforcement, &[22, 443]), policy(0, Mode::Simulation, &[22])] {
                assert!(really_changed(&stored, &next).unwrap());
            }
        }
        let corrupt = store::Persisted { version: 7, bytes: vec![0xff, 0x01] };
        assert!(really_changed(&corrupt, &policy(0, Mode::Enforcement, &[22])).is_err());
    }

    #[test]
    fn content_is_the_policy_without_its_version() {
        let (one, two) = (policy(1, Mode::Enforcement, &[22]), policy(2, Mode::Enforcement, &[22]));
        assert_eq!(store::Content::of(&one), store::Content::of(&two));
        assert_eq!(store::Content::of(&one).bytes, policy(0, Mode::Enforcement, &[22]).canonical_bytes());
        assert_ne!(
            store::Content::of(&one).digest,
            store::Content::of(&policy(1, Mode::Simulation, &[22])).digest
        );
    }
}
