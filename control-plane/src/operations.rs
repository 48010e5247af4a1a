//! Every authored operator change as one library call. Each takes the actor and the validated
//! spec, goes through `foresight::commit` (written, rendered, judged by the policy tests and
//! audited in one transaction) and owns its audit record: the action, the subject and the
//! detail are written here and nowhere else. The CLI (on this host's database), the HTTP API
//! (and through it the remote CLI) and the console only parse, authorize and print, so the same
//! change leaves the same record whichever edge it came through (`one_operation_one_audit`).
//!
//! The other operator operations own their records where they live: `authoring::render_audited`
//! and `request_snapshot`, `gate::promote`, `foresight::drafts`, the test sets of
//! `foresight::commit`, `suggest::accept` and `ignore`, and the tokens of `identity`.

use std::net::IpAddr;

use innerwall_wire::identity::WorkloadId;
use innerwall_wire::labels::{Label, LabelKey};
use innerwall_wire::policy::Cidr;
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::counts::CountBounds;
use crate::error::Error;
use crate::foresight::{commit, commit_touching};
use crate::policy::authoring::{self, Committed, LabelsReplaced};
use crate::policy::publish::Touched;
use crate::policy::spec::{AddressGroupSpec, RulesetSpec, ServiceSpec};

/// The detail of a service's create or update: its entries in their canonical text
/// (`tcp:all` reads `tcp:1-65535`, as the rendered policy has it).
fn entries(spec: &ServiceSpec) -> Value {
    json!({"entries": spec.entries.iter().map(ToString::to_string).collect::<Vec<_>>()})
}

/// The detail of an address group's create or update: its CIDRs in their canonical text.
fn cidrs(spec: &AddressGroupSpec) -> Value {
    json!({"cidrs": spec.cidrs.iter().map(ToString::to_string).collect::<Vec<_>>()})
}

/// The detail of a ruleset's create or update: the ruleset as written.
fn ruleset(spec: &RulesetSpec) -> Value {
    serde_json::to_value(spec).expect("a ruleset spec is plain data")
}

/// `service.create`: a new service at version 1, within the count bound.
pub async fn create_service(
    pool: &PgPool,
    actor: &str,
    spec: &ServiceSpec,
    counts: &CountBounds,
) -> Result<Committed<()>, Error> {
    let touched = [Touched::Service(spec.name.clone())];
    commit_touching(pool, actor, "service.create", &spec.name, &touched, async |c| {
        authoring::create_service_within(c, spec, counts).await?;
        Ok(((), entries(spec)))
    })
    .await
}

/// `service.update`, conditional on the version read; returns the new version.
pub async fn update_service(
    pool: &PgPool,
    actor: &str,
    spec: &ServiceSpec,
    expected: i64,
) -> Result<Committed<i64>, Error> {
    let touched = [Touched::Service(spec.name.clone())];
    commit_touching(pool, actor, "service.update", &spec.name, &touched, async |c| {
        Ok((authoring::update_service(c, spec, expected).await?, entries(spec)))
    })
    .await
}

/// `service.delete`, conditional on the version read; refused while rules use it.
pub async fn delete_service(
    pool: &PgPool,
    actor: &str,
    name: &str,
    expected: i64,
) -> Result<Committed<()>, Error> {
    let touched = [Touched::Service(name.to_owned())];
    commit_touching(pool, actor, "service.delete", name, &touched, async |c| {
        authoring::delete_service(c, name, expected).await?;
        Ok(((), json!({})))
    })
    .await
}

/// `address-group.create`: a new address group at version 1, within the count bound.
pub async fn create_address_group(
    pool: &PgPool,
    actor: &str,
    spec: &AddressGroupSpec,
    counts: &CountBounds,
) -> Result<Committed<()>, Error> {
    let touched = [Touched::AddressGroup(spec.name.clone())];
    commit_touching(pool, actor, "address-group.create", &spec.name, &touched, async |c| {
        authoring::create_address_group_within(c, spec, counts).await?;
        Ok(((), cidrs(spec)))
    })
    .await
}

/// `address-group.update`, conditional on the version read; returns the new version.
pub async fn update_address_group(
    pool: &PgPool,
    actor: &str,
    spec: &AddressGroupSpec,
    expected: i64,
) -> Result<Committed<i64>, Error> {
    let touched = [Touched::AddressGroup(spec.name.clone())];
    commit_touching(pool, actor, "address-group.update", &spec.name, &touched, async |c| {
        Ok((authoring::update_address_group(c, spec, expected).await?, cidrs(spec)))
    })
    .await
}

/// `address-group.delete`, conditional on the version read; refused while rules use it.
pub async fn delete_address_group(
    pool: &PgPool,
    actor: &str,
    name: &str,
    expected: i64,
) -> Result<Committed<()>, Error> {
    let touched = [Touched::AddressGroup(name.to_owned())];
    commit_touching(pool, actor, "address-group.delete", name, &touched, async |c| {
        authoring::delete_address_group(c, name, expected).await?;
        Ok(((), json!({})))
    })
    .await
}

/// `ruleset.create`: a new ruleset at version 1, within the count bound.
pub async fn create_ruleset(
    pool: &PgPool,
    actor: &str,
    spec: &RulesetSpec,
    counts: &CountBounds,
) -> Result<Committed<()>, Error> {
    let touched = [Touched::Ruleset(spec.name.clone())];
    commit_touching(pool, actor, "ruleset.create", &spec.name, &touched, async |c| {
        authoring::create_ruleset_within(c, spec, counts).await?;
        Ok(((), ruleset(spec)))
    })
    .await
}

/// `ruleset.update`: replaces the ruleset named by `spec` (rules keep their identity by name),
/// conditional on the version read; returns the new version.
pub async fn update_ruleset(
    pool: &PgPool,
    actor: &str,
    spec: &RulesetSpec,
    expected: i64,
) -> Result<Committed<i64>, Error> {
    let touched = [Touched::Ruleset(spec.name.clone())];
    commit_touching(pool, actor, "ruleset.update", &spec.name, &touched, async |c| {
        Ok((authoring::update_ruleset(c, spec, expected).await?, ruleset(spec)))
    })
    .await
}

/// `ruleset.delete`, conditional on the version read.
pub async fn delete_ruleset(
    pool: &PgPool,
    actor: &str,
    name: &str,
    expected: i64,
) -> Result<Committed<()>, Error> {
    let touched = [Touched::Ruleset(name.to_owned())];
    commit_touching(pool, actor, "ruleset.delete", name, &touched, async |c| {
        authoring::delete_ruleset(c, name, expected).await?;
        Ok(((), json!({})))
    })
    .await
}

/// The detail of a label change: what it set and removed (nothing when it changed nothing).
fn labels(done: &LabelsReplaced) -> Value {
    json!({"set": done.set, "removed": done.removed})
}

/// `workload.label`: sets and removes labels, conditional on the label-set version read (IDN-6).
pub async fn change_labels(
    pool: &PgPool,
    actor: &str,
    id: WorkloadId,
    expected: i64,
    set: &[Label],
    remove: &[LabelKey],
) -> Result<Committed<LabelsReplaced>, Error> {
    commit_touching(pool, actor, "workload.label", &id.to_string(), &[Touched::Labels(id)], async |c| {
        let done = authoring::change_labels(c, id, expected, set, remove).await?;
        let detail = labels(&done);
        Ok((done, detail))
    })
    .await
}

/// `workload.label`: replaces the whole label set, conditional on the label-set version read;
/// audited as the set and removed labels it amounts to, as [`change_labels`] is.
pub async fn replace_labels(
    pool: &PgPool,
    actor: &str,
    id: WorkloadId,
    expected: i64,
    new: &[Label],
) -> Result<Committed<LabelsReplaced>, Error> {
    commit_touching(pool, actor, "workload.label", &id.to_string(), &[Touched::Labels(id)], async |c| {
        let done = authoring::replace_labels(c, id, expected, new).await?;
        let detail = labels(&done);
        Ok((done, detail))
    })
    .await
}

/// `workload.release-address`: drops the workload's claim to `address`.
pub async fn release_address(
    pool: &PgPool,
    actor: &str,
    id: WorkloadId,
    address: IpAddr,
) -> Result<Committed<()>, Error> {
    commit(pool, actor, "workload.release-address", &id.to_string(), async |c| {
        authoring::release_address(c, id, address).await?;
        Ok(((), json!({"address": address.to_string()})))
    })
    .await
}

/// `workload.retire` (IDN-7).
pub async fn retire(pool: &PgPool, actor: &str, id: WorkloadId) -> Result<Committed<()>, Error> {
    commit(pool, actor, "workload.retire", &id.to_string(), async |c| {
        authoring::retire(c, id).await?;
        Ok(((), json!({})))
    })
    .await
}

/// `workload.deny` (IDN-7).
pub async fn deny(pool: &PgPool, actor: &str, id: WorkloadId) -> Result<Committed<()>, Error> {
    commit(pool, actor, "workload.deny", &id.to_string(), async |c| {
        authoring::deny(c, id).await?;
        Ok(((), json!({})))
    })
    .await
}

/// `estate-range.add`.
pub async fn add_estate_range(
    pool: &PgPool,
    actor: &str,
    range: Cidr,
    description: &str,
) -> Result<Committed<()>, Error> {
    commit(pool, actor, "estate-range.add", &range.to_string(), async |c| {
        authoring::add_estate_range(c, range, description).await?;
        Ok(((), json!({"description": description})))
    })
    .await
}

/// `estate-range.remove`.
pub async fn remove_estate_range(pool: &PgPool, actor: &str, range: Cidr) -> Result<Committed<()>, Error> {
    commit(pool, actor, "estate-range.remove", &range.to_string(), async |c| {
        authoring::remove_estate_range(c, range).await?;
        Ok(((), json!({})))
    })
    .await
}
