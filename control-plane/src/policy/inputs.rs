//! The render's inputs kept between publishes (issue 33, POL-7, PERF-1). Loading the authored
//! model and the registry whole costs a publish more than rendering the few workloads a small
//! change touches (about 75 ms at 10,000 workloads), so the replica keeps what its last publish
//! rendered from, named by the generation of the inputs it was (migration 0041): every statement
//! that writes a table a render reads first takes the render lock and gives the generation a new
//! random value, and tells its transaction what it wrote.
//!
//! Under the render lock a publish reuses what it kept only when the committed generation is
//! still the one it kept (no other transaction, of this replica or another, changed an input
//! since), and its own transaction wrote nothing, or only what the change it publishes names
//! (`publish::Touched`: a workload's labels, an address group, a service, a ruleset, workloads
//! enrolled) and can be read again alone. Anything else loads the inputs whole. What it keeps is
//! named by the generation its own transaction leaves, so a rollback leaves a name no one
//! commits, and the next publish loads.
//!
//! Debug builds (every test) load the inputs whole beside each reuse and fail the publish if the
//! two differ.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use innerwall_wire::identity::WorkloadId;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::error::Error;
use crate::policy::model::{AuthoredModel, RegisteredWorkload, Ruleset};
use crate::policy::narrow::Consumers;
use crate::policy::narrow::Touched;
use crate::policy::render::LabelIndex;
use crate::policy::store::{self, Registry};
use crate::policy::{addresses, off_thread};

/// What a render reads, as the database holds it at `generation`.
#[derive(Debug, Clone)]
pub struct Inputs {
    pub model: Arc<AuthoredModel>,
    /// The registry with its stored address standings.
    pub registry: Arc<Registry>,
    /// Every reported address of `registry`'s live workloads, judged now (the publish stores
    /// those that differ from the stored standings).
    pub standings: Arc<addresses::Standings>,
    /// The live workloads with only their accepted addresses: what is rendered.
    pub accepted: Arc<Vec<RegisteredWorkload>>,
    /// The label index of `accepted`.
    pub labels: Arc<LabelIndex>,
    /// The consumers of `model`'s rules (`narrow`).
    pub consumers: Arc<Consumers>,
}

impl Inputs {
    /// The inputs of this model, its consumers index and this registry, judged and indexed.
    fn new(model: Arc<AuthoredModel>, consumers: Consumers, registry: Registry) -> Inputs {
        let (standings, accepted, labels) = std::thread::scope(|scope| {
            // Of labels and positions only, which the accepted workloads share with the
            // registry's: built on another core while the addresses are judged.
            let labels = scope.spawn(|| LabelIndex::new(&registry.workloads));
            let standings = standings(&registry);
            let accepted = accepted_by(&registry, &standings);
            (standings, accepted, labels.join().expect("indexing labels does not panic"))
        });
        Inputs {
            labels: Arc::new(labels),
            consumers: Arc::new(consumers),
            model,
            registry: Arc::new(registry),
            standings: Arc::new(standings),
            accepted: Arc::new(accepted),
        }
    }
}

struct Kept {
    generation: Uuid,
    inputs: Inputs,
}

/// The kept inputs of each database this process renders for (one for a replica; a test
/// process serves many), by the database's identity: its oid and the server's start. Only the
/// generation decides whether they are still true; the identity only keeps databases apart.
static KEPT: Mutex<Vec<(String, Kept)>> = Mutex::new(Vec::new());

/// At most this many databases' inputs are kept (the oldest kept goes).
const KEPT_DATABASES: usize = 16;

fn take(database: &str) -> Option<Kept> {
    let mut kept = KEPT.lock().expect("kept inputs lock");
    let at = kept.iter().position(|(d, _)| d == database)?;
    Some(kept.remove(at).1)
}

pub use crate::metrics::RenderInputs as Outcome;

/// The generation and what the caller's transaction wrote since it began or last published.
struct Written {
    database: String,
    generation: Uuid,
    /// The generation before this transaction's writes; `None`: it wrote none.
    base: Option<Uuid>,
    tables: BTreeSet<String>,
}

async fn written(conn: &mut PgConnection) -> Result<Written, Error> {
    type Row = (String, Uuid, Option<String>, Option<String>, Option<String>);
    let (database, generation, pending, base, tables): Row = sqlx::query_as(
        "SELECT (SELECT oid FROM pg_database WHERE datname = current_database())::text || '@'
                    || pg_postmaster_start_time()::text,
                generation, current_setting('innerwall.inputs_pending', true),
                current_setting('innerwall.inputs_base', true), current_setting('innerwall.inputs_tables', true)
         FROM render_inputs",
    )
    .fetch_one(&mut *conn)
    .await?;
    let base = match pending.as_deref() {
        Some("yes") => {
            let text = base.unwrap_or_default();
            Some(
                text.parse()
                    .map_err(|_| Error::Corrupt { what: "render inputs generation", detail: text })?,
            )
        }
        _ => None,
    };
    let tables = tables.unwrap_or_default().split(',').filter(|t| !t.is_empty()).map(String::from).collect();
    Ok(Written { database, generation, base, tables })
}

/// Inputs reused from the last publish ([`kept`]).
#[derive(Debug)]
pub struct Reused {
    pub inputs: Inputs,
    pub outcome: Outcome,
    /// Each ruleset this transaction wrote (`Touched::Ruleset`) as it was before (`None`: new).
    pub rulesets_before: BTreeMap<String, Option<Ruleset>>,
}

/// The inputs kept from the last publish, brought up to what this transaction wrote, or `None`
/// when they must be loaded whole. Called under the render lock.
pub async fn kept(conn: &mut PgConnection, touched: &[Touched]) -> Result<Option<Reused>, Error> {
    let written = written(conn).await?;
    let Some(kept) = take(&written.database) else { return Ok(None) };
    if kept.generation != written.base.unwrap_or(written.generation) {
        return Ok(None);
    }
    let reused = match written.base {
        None => Reused { inputs: kept.inputs, outcome: Outcome::Kept, rulesets_before: BTreeMap::new() },
        Some(_) => match refresh(conn, kept.inputs, &written.tables, touched).await? {
            Some(reused) => reused,
            None => return Ok(None),
        },
    };
    if cfg!(debug_assertions) {
        verify(conn, &reused.inputs).await?;
    }
    Ok(Some(reused))
}

/// The inputs loaded whole: the workloads to render with the addresses address trust accepts of
/// their claims now, the standings as stored (the publish stores those that moved).
pub async fn load(conn: &mut PgConnection) -> Result<Inputs, Error> {
    let model = Arc::new(store::load_model(conn).await?);
    // The model's consumers index is built on another core while the registry loads.
    let consumers = off_thread({
        let model = Arc::clone(&model);
        move || Consumers::new(&model)
    });
    let registry = store::load_registry(conn).await?;
    Ok(Inputs::new(model, consumers.await, registry))
}

/// Keeps `inputs` as what the caller's transaction holds now; called at the end of a publish,
/// after its own writes. A later write in the same transaction names a new generation.
pub async fn keep(conn: &mut PgConnection, inputs: &Inputs) -> Result<(), Error> {
    let (database, generation): (String, Uuid) = sqlx::query_as(
        "SELECT (SELECT oid FROM pg_database WHERE datname = current_database())::text || '@'
                    || pg_postmaster_start_time()::text,
                generation
         FROM render_inputs, set_config('innerwall.inputs_pending', '', true)",
    )
    .fetch_one(&mut *conn)
    .await?;
    let mut kept = KEPT.lock().expect("kept inputs lock");
    kept.retain(|(d, _)| *d != database);
    if kept.len() >= KEPT_DATABASES {
        kept.remove(0);
    }
    kept.push((database, Kept { generation, inputs: inputs.clone() }));
    Ok(())
}

/// `inputs` with what `touched` names read again, when the tables this transaction wrote are
/// all what those edits write; `None` otherwise.
async fn refresh(
    conn: &mut PgConnection,
    mut inputs: Inputs,
    tables: &BTreeSet<String>,
    touched: &[Touched],
) -> Result<Option<Reused>, Error> {
    let mut labels = Vec::new();
    let mut groups = Vec::new();
    let mut services = Vec::new();
    let mut rulesets = Vec::new();
    let mut enrolled = Vec::new();
    for t in touched {
        match t {
            Touched::Labels(id) => labels.push(id.uuid()),
            Touched::AddressGroup(name) => groups.push(name.clone()),
            Touched::Service(name) => services.push(name.clone()),
            Touched::Ruleset(name) => rulesets.push(name.clone()),
            Touched::Enrolled(id) => enrolled.push(id.uuid()),
        }
    }
    let covered = |table: &str| match table {
        "workload_labels" => !labels.is_empty() || !enrolled.is_empty(),
        // An enrollment inserts the workload, its addresses and ranges.
        "workloads" | "workload_addresses" | "workload_ranges" => !enrolled.is_empty(),
        "address_groups" | "address_group_cidrs" => !groups.is_empty(),
        "services" | "service_entries" => !services.is_empty(),
        "rulesets" | "rules" | "rule_peers" | "rule_services" => !rulesets.is_empty(),
        _ => false,
    };
    // A staged ruleset resolves its groups, services and the rule ids of the ruleset it
    // replaces when loaded.
    let authored = !groups.is_empty() || !services.is_empty() || !rulesets.is_empty();
    if !tables.iter().all(|t| covered(t)) || (authored && !inputs.model.staged.is_empty()) {
        return Ok(None);
    }
    let mut rulesets_before = BTreeMap::new();
    if !rulesets.is_empty() {
        let model = Arc::make_mut(&mut inputs.model);
        let mut now: BTreeMap<String, Ruleset> = store::load_rulesets(conn, Some(&rulesets))
            .await?
            .into_iter()
            .map(|r| (r.name.clone(), r))
            .collect();
        for name in &rulesets {
            let at = model.rulesets.iter().position(|r| &r.name == name);
            let before = at.map(|at| model.rulesets.remove(at));
            if let Some(ruleset) = now.remove(name) {
                // In the database's order of names (its collation, not Rust's): load_model's.
                let at: i64 = sqlx::query_scalar("SELECT count(*) FROM rulesets WHERE name < $1")
                    .bind(name)
                    .fetch_one(&mut *conn)
                    .await?;
                model.rulesets.insert((at as usize).min(model.rulesets.len()), ruleset);
            }
            rulesets_before.entry(name.clone()).or_insert(before);
        }
        inputs.consumers = Arc::new(Consumers::new(model));
    }
    if !groups.is_empty() || !services.is_empty() {
        let model = Arc::make_mut(&mut inputs.model);
        if !groups.is_empty() {
            model.address_groups.retain(|_, g| !groups.contains(&g.name));
            model.address_groups.extend(store::load_address_groups(conn, Some(&groups)).await?);
        }
        if !services.is_empty() {
            model.services.retain(|_, s| !services.contains(&s.name));
            model.services.extend(store::load_services(conn, Some(&services)).await?);
        }
    }
    if !labels.is_empty() {
        let mut now = store::load_labels(conn, Some(&labels)).await?;
        let registry = Arc::make_mut(&mut inputs.registry);
        let accepted = Arc::make_mut(&mut inputs.accepted);
        let index = Arc::make_mut(&mut inputs.labels);
        for id in &labels {
            let fresh = now.remove(id).unwrap_or_default();
            if let Ok(at) = registry.workloads.binary_search_by_key(id, |w| w.id.uuid()) {
                registry.workloads[at].labels = fresh.clone();
            }
            if let Ok(at) = accepted.binary_search_by_key(id, |w| w.id.uuid()) {
                index.relabel(at, &accepted[at].labels, &fresh);
                accepted[at].labels = fresh;
            }
        }
    }
    if !enrolled.is_empty() && !enroll(conn, &mut inputs, &enrolled).await? {
        return Ok(None);
    }
    Ok(Some(Reused { inputs, outcome: Outcome::Refreshed, rulesets_before }))
}

/// Adds the workloads `ids` enrolled to `inputs`: false (load whole) if one was there already.
/// A standing depends on the workload's own claims and on the other workloads that hold the
/// same address, where only a claim inside the estate ranges and its token's ranges holds one
/// (`addresses::judge`). So the new ones are judged among themselves, and when no workload there
/// already holds an address a new one holds, nothing else moves: a claim outside the ranges (an
/// address every host of a fleet reports and its tokens do not allow) takes nothing from anyone.
/// Otherwise (a host enrolled again beside its old workload, say) every claim is judged again.
/// The label index is built again either way.
async fn enroll(conn: &mut PgConnection, inputs: &mut Inputs, ids: &[Uuid]) -> Result<bool, Error> {
    let (workloads, narrowed, stored) = store::load_workloads(conn, Some(ids)).await?;
    let registry = Arc::make_mut(&mut inputs.registry);
    let new: Vec<WorkloadId> = workloads.iter().map(|w| w.id).collect();
    for workload in workloads {
        match registry.workloads.binary_search_by_key(&workload.id, |w| w.id) {
            Ok(_) => return Ok(false),
            Err(at) => registry.workloads.insert(at, workload),
        }
    }
    registry.narrowed.extend(narrowed);
    registry.stored.extend(stored);
    let at = |id: &WorkloadId| {
        registry.workloads.binary_search_by_key(id, |w| w.id).ok().map(|i| &registry.workloads[i])
    };
    let newcomers: Vec<&RegisteredWorkload> = new.iter().filter_map(at).collect();
    let judged = addresses::judge(
        &registry.estate,
        newcomers.iter().map(|w| addresses::Claim {
            workload: w.id,
            addresses: &w.addresses,
            narrowed_to: registry.narrowed.get(&w.id).map_or(&[], Vec::as_slice),
        }),
    );
    let held: BTreeSet<std::net::IpAddr> = addresses::held(&judged).collect();
    let shared = !held.is_empty() && addresses::held(&inputs.standings).any(|a| held.contains(&a));
    if shared {
        let standings = standings(registry);
        let accepted = accepted_by(registry, &standings);
        inputs.labels = Arc::new(LabelIndex::new(&accepted));
        inputs.standings = Arc::new(standings);
        inputs.accepted = Arc::new(accepted);
        return Ok(true);
    }
    let accepted = Arc::make_mut(&mut inputs.accepted);
    for w in newcomers {
        let workload = RegisteredWorkload { addresses: addresses::accepted(&judged, w.id), ..w.clone() };
        let place = accepted.binary_search_by_key(&w.id, |a| a.id).unwrap_or_else(|place| place);
        accepted.insert(place, workload);
    }
    inputs.labels = Arc::new(LabelIndex::new(accepted));
    Arc::make_mut(&mut inputs.standings).extend(judged);
    Ok(true)
}

/// Debug builds: the inputs kept equal the inputs loaded whole.
async fn verify(conn: &mut PgConnection, inputs: &Inputs) -> Result<(), Error> {
    let loaded = load(conn).await?;
    let diverged = |what: &str| Error::Corrupt {
        what: "kept render inputs",
        detail: format!("the {what} kept differs from the {what} loaded"),
    };
    if inputs.model != loaded.model {
        return Err(diverged("model"));
    }
    if inputs.registry != loaded.registry {
        return Err(diverged("registry"));
    }
    if inputs.standings != loaded.standings {
        return Err(diverged("address standings"));
    }
    if inputs.accepted != loaded.accepted {
        return Err(diverged("accepted registry"));
    }
    if inputs.labels != loaded.labels {
        return Err(diverged("label index"));
    }
    if inputs.consumers != loaded.consumers {
        return Err(diverged("consumers index"));
    }
    Ok(())
}

/// The standing of every reported address of every live workload of `registry`.
fn standings(registry: &Registry) -> addresses::Standings {
    let claims = registry.workloads.iter().map(|w| addresses::Claim {
        workload: w.id,
        addresses: &w.addresses,
        narrowed_to: registry.narrowed.get(&w.id).map_or(&[], Vec::as_slice),
    });
    addresses::judge(&registry.estate, claims)
}

/// The live workloads of `registry` with only the addresses address trust accepts of their
/// claims (judged again, not as stored).
pub(crate) fn accepted_only(registry: &Registry) -> Vec<RegisteredWorkload> {
    accepted_by(registry, &standings(registry))
}

/// The live workloads of `registry` with only the addresses `standings` accepts.
fn accepted_by(registry: &Registry, standings: &addresses::Standings) -> Vec<RegisteredWorkload> {
    registry
        .workloads
        .iter()
        .map(|w| RegisteredWorkload { addresses: addresses::accepted(standings, w.id), ..w.clone() })
        .collect()
}
