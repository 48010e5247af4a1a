//! Where a command's operations go: this host's database ([`Ctx`], the library's calls) or a
//! control plane's operator API ([`ApiClient`], the routes that make the same calls). Each
//! command is written once against [`Backend`] and prints what either answers with the same
//! printers, so the local and the remote CLI print the same bytes; writes answer an [`Outcome`]
//! whichever way they went.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::bail;
use innerwall_control_plane::api::drafts::DraftImpact;
use innerwall_control_plane::api::workloads::Labels;
use innerwall_control_plane::audit::{self, AuditRow};
use innerwall_control_plane::counts::CountBounds;
use innerwall_control_plane::flows::{self, FlowRow, GapRow, Page, PageRequest, RollupRow};
use innerwall_control_plane::foresight::drafts::{
    ChangeFile, DraftCommitted, DraftRender, DraftSummary, DraftView,
};
use innerwall_control_plane::foresight::{self, Impact, RunReport, TestSetRow, TestSetSpec, drafts};
use innerwall_control_plane::gate::{self, Promotion, Scope, Verdict};
use innerwall_control_plane::identity::tokens::{self, TokenView};
use innerwall_control_plane::operations;
use innerwall_control_plane::policy::authoring::{self, LabelsReplaced, ResendRequested};
use innerwall_control_plane::policy::model::{Management, Selector};
use innerwall_control_plane::policy::spec::RulesetSpec;
use innerwall_control_plane::policy::store::{
    self, EstateRangeView, PolicyView, RulesetView, SyncStatusView, WorkloadRow, WorkloadView,
};
use innerwall_control_plane::safety::confirm;
use innerwall_control_plane::safety::management::{self, ManagementListing, Scope as ManagementScope};
use innerwall_control_plane::safety::rollback::{self, RolledBack, Target};
use innerwall_control_plane::safety::staged::{self, PromoteStaged, StagedPromotion, StagedView};
use innerwall_control_plane::suggest::{self, Accepted, Suggestions};
use innerwall_wire::identity::WorkloadId;
use innerwall_wire::labels::{Label, LabelKey};
use innerwall_wire::policy::Cidr;
use uuid::Uuid;

use crate::api::{ApiClient, segment, with_query};
use crate::ctx::Ctx;
use crate::output::Outcome;
use crate::pages;
use crate::replay::ReplayArgs;
use crate::requests::{
    AuditQuery, Catalog, EvidenceArgs, Minted, RecordQuery, Rollup, ScopeArgs, SuggestArgs, gaps_path,
};

/// A workload's API path.
fn workload(id: WorkloadId) -> String {
    format!("/api/v1/workloads/{id}")
}

const RULESETS: &str = "/api/v1/rulesets";
const STAGED: &str = "/api/v1/staged-rulesets";
const TEST_SETS: &str = "/api/v1/policy-test-sets";
const ESTATE_RANGES: &str = "/api/v1/estate-ranges";
const MANAGEMENT: &str = "/api/v1/management";
const DRAFTS: &str = "/api/v1/drafts";
const SUGGESTIONS: &str = "/api/v1/suggestions";
const TOKENS: &str = "/api/v1/provisioning-tokens";

/// A draft's API path.
fn draft(name: &str) -> String {
    format!("{DRAFTS}/{}", segment(name))
}

/// How many workloads a page the CLI asks for holds (each row carries up to 256 addresses, so
/// a page stays well under the client's response bound).
const WORKLOAD_PAGE: u32 = 200;

/// The most `--id`s a remote verdict sends: they travel in the query string, which the API
/// bounds with its headers.
const MAX_QUERY_IDS: usize = 200;

/// The operations of the CLI's commands, on either side. Arguments are checked before they
/// are sent, so a bad one is refused the same way on both, before anything is read.
pub trait Backend {
    // ---- services and address groups (`Catalog`) ----
    async fn create<A: Catalog>(&self, args: &A) -> anyhow::Result<Outcome<()>>;
    async fn update<A: Catalog>(&self, args: &A, expected: i64) -> anyhow::Result<Outcome<i64>>;
    async fn delete<A: Catalog>(&self, name: &str, expected: i64) -> anyhow::Result<Outcome<()>>;
    async fn list<A: Catalog>(&self) -> anyhow::Result<Vec<A::View>>;
    async fn show<A: Catalog>(&self, name: &str) -> anyhow::Result<A::View>;

    // ---- rulesets ----
    async fn create_ruleset(&self, spec: &RulesetSpec) -> anyhow::Result<Outcome<()>>;
    async fn update_ruleset(&self, spec: &RulesetSpec, expected: i64) -> anyhow::Result<Outcome<i64>>;
    async fn delete_ruleset(&self, name: &str, expected: i64) -> anyhow::Result<Outcome<()>>;
    async fn rulesets(&self) -> anyhow::Result<Vec<RulesetView>>;
    async fn ruleset(&self, name: &str) -> anyhow::Result<RulesetView>;
    /// Stages a ruleset (FLOW-10); its stage number.
    async fn stage_ruleset(&self, spec: &RulesetSpec) -> anyhow::Result<Outcome<i64>>;
    async fn unstage_ruleset(&self, name: &str) -> anyhow::Result<Outcome<()>>;
    async fn staged_rulesets(&self) -> anyhow::Result<Vec<StagedView>>;
    async fn promote_staged(&self, request: &PromoteStaged) -> anyhow::Result<Outcome<StagedPromotion>>;

    /// Every workload rendered now, audited.
    async fn render(&self) -> anyhow::Result<Outcome<()>>;

    // ---- policy tests ----
    async fn create_test_set(&self, spec: &TestSetSpec) -> anyhow::Result<Outcome<i64>>;
    async fn update_test_set(&self, spec: &TestSetSpec, expected: i64) -> anyhow::Result<Outcome<i64>>;
    async fn delete_test_set(&self, name: &str, expected: i64) -> anyhow::Result<Outcome<()>>;
    async fn test_sets(&self) -> anyhow::Result<Vec<TestSetRow>>;
    async fn test_set(&self, name: &str) -> anyhow::Result<TestSetRow>;
    /// Every policy test on the estate as rendered now, or as `draft` would render it.
    async fn run_tests(&self, draft: Option<&str>) -> anyhow::Result<RunReport>;

    // ---- estate ranges ----
    async fn add_estate_range(&self, range: Cidr, description: &str) -> anyhow::Result<Outcome<()>>;
    async fn remove_estate_range(&self, range: Cidr) -> anyhow::Result<Outcome<()>>;
    async fn estate_ranges(&self) -> anyhow::Result<Vec<EstateRangeView>>;

    // ---- management access ----
    async fn management(&self) -> anyhow::Result<ManagementListing>;
    async fn narrow_management(
        &self,
        scope: ManagementScope,
        set: &Management,
    ) -> anyhow::Result<Outcome<()>>;
    /// Only on this host's database: the API does not offer it.
    async fn reset_management(&self, set: &Management) -> anyhow::Result<Outcome<()>>;

    // ---- workloads ----
    /// Every workload, retired and deny-listed ones too, in attention order.
    async fn workloads(&self) -> anyhow::Result<Vec<WorkloadRow>>;
    async fn workload(&self, id: WorkloadId) -> anyhow::Result<WorkloadView>;
    async fn change_labels(
        &self,
        id: WorkloadId,
        expected: i64,
        set: &[Label],
        remove: &[LabelKey],
    ) -> anyhow::Result<Outcome<LabelsReplaced>>;
    async fn verdict(&self, scope: &ScopeArgs, evidence: &EvidenceArgs) -> anyhow::Result<Verdict>;
    /// A count-pinned mode change: `request` as `scope` and `evidence` gave it.
    async fn promote(
        &self,
        request: &gate::Request,
        scope: &ScopeArgs,
        evidence: &EvidenceArgs,
    ) -> anyhow::Result<Promotion>;
    /// One workload's convergence, or every live workload's by hostname.
    async fn sync_status(&self, id: Option<WorkloadId>) -> anyhow::Result<Vec<SyncStatusView>>;
    async fn resend_snapshot(&self, id: WorkloadId) -> anyhow::Result<ResendRequested>;
    async fn rollback(
        &self,
        scope: &Scope,
        args: &ScopeArgs,
        expect_count: usize,
        target: Target,
    ) -> anyhow::Result<Outcome<Vec<RolledBack>>>;
    async fn unpin(&self, id: WorkloadId) -> anyhow::Result<Outcome<()>>;
    async fn retire(&self, id: WorkloadId) -> anyhow::Result<Outcome<()>>;
    async fn deny(&self, id: WorkloadId) -> anyhow::Result<Outcome<()>>;
    async fn release_address(&self, id: WorkloadId, address: std::net::IpAddr)
    -> anyhow::Result<Outcome<()>>;
    async fn policy(&self, id: WorkloadId) -> anyhow::Result<PolicyView>;
    async fn replay(&self, id: WorkloadId, from: u64, to: u64, args: &ReplayArgs) -> anyhow::Result<Impact>;

    // ---- drafts ----
    async fn create_draft(&self, name: &str, note: &str) -> anyhow::Result<DraftView>;
    async fn drafts(&self) -> anyhow::Result<Vec<DraftSummary>>;
    async fn draft(&self, name: &str) -> anyhow::Result<DraftView>;
    async fn add_to_draft(&self, name: &str, file: &ChangeFile) -> anyhow::Result<DraftView>;
    async fn render_draft(&self, name: &str) -> anyhow::Result<DraftRender>;
    async fn draft_impact(&self, name: &str, args: &ReplayArgs) -> anyhow::Result<DraftImpact>;
    async fn discard_draft(&self, name: &str, expected: i64) -> anyhow::Result<Outcome<()>>;
    async fn commit_draft(&self, name: &str, expected: i64) -> anyhow::Result<Outcome<DraftCommitted>>;

    // ---- suggestions ----
    async fn suggestions(&self, args: &SuggestArgs) -> anyhow::Result<Suggestions>;
    async fn accept_suggestions(&self, ids: &[String], draft: &str) -> anyhow::Result<Accepted>;
    async fn ignore_suggestions(&self, ids: &[String]) -> anyhow::Result<()>;

    // ---- provisioning tokens ----
    async fn mint_token(
        &self,
        labels: &[Label],
        ttl: chrono::Duration,
        max_uses: Option<u32>,
        ranges: &[Cidr],
    ) -> anyhow::Result<Minted>;
    async fn tokens(&self) -> anyhow::Result<Vec<TokenView>>;
    async fn revoke_token(&self, id: Uuid) -> anyhow::Result<()>;

    // ---- flows ----
    async fn flow_records(&self, query: &RecordQuery, page: &PageRequest) -> anyhow::Result<Page<FlowRow>>;
    async fn flow_gaps(
        &self,
        workload: Option<WorkloadId>,
        since: Duration,
        page: &PageRequest,
    ) -> anyhow::Result<Page<GapRow>>;
    async fn flow_rollup(&self, rollup: &Rollup, page: &PageRequest) -> anyhow::Result<Page<RollupRow>>;
    /// Whether no live workload matches `selector` (written `text`) now.
    async fn scope_is_empty(&self, text: &str, selector: &Selector) -> anyhow::Result<bool>;

    // ---- records ----
    /// The newest promotion records, at most `limit` (every one without).
    async fn promotions(&self, limit: Option<u32>) -> anyhow::Result<Vec<Promotion>>;
    async fn promotion(&self, id: Uuid) -> anyhow::Result<Promotion>;
    async fn confirm_promotion(&self, id: Uuid, override_reason: Option<&str>) -> anyhow::Result<Promotion>;
    async fn audit(&self, query: &AuditQuery) -> anyhow::Result<Vec<AuditRow>>;
}

impl Backend for Ctx {
    async fn create<A: Catalog>(&self, args: &A) -> anyhow::Result<Outcome<()>> {
        let spec = args.spec()?;
        Ok(A::create(&self.pool, &self.actor, &spec, &CountBounds::default()).await?.into())
    }
    async fn update<A: Catalog>(&self, args: &A, expected: i64) -> anyhow::Result<Outcome<i64>> {
        let spec = args.spec()?;
        Ok(A::update(&self.pool, &self.actor, &spec, expected).await?.into())
    }
    async fn delete<A: Catalog>(&self, name: &str, expected: i64) -> anyhow::Result<Outcome<()>> {
        Ok(A::delete(&self.pool, &self.actor, name, expected).await?.into())
    }
    async fn list<A: Catalog>(&self) -> anyhow::Result<Vec<A::View>> {
        let mut conn = self.pool.acquire().await?;
        pages::local(self.page_size, None, async |r| A::page(&mut conn, r).await).await
    }
    async fn show<A: Catalog>(&self, name: &str) -> anyhow::Result<A::View> {
        Ok(A::show(&mut *self.pool.acquire().await?, name).await?)
    }

    async fn create_ruleset(&self, spec: &RulesetSpec) -> anyhow::Result<Outcome<()>> {
        Ok(operations::create_ruleset(&self.pool, &self.actor, spec, &CountBounds::default()).await?.into())
    }
    async fn update_ruleset(&self, spec: &RulesetSpec, expected: i64) -> anyhow::Result<Outcome<i64>> {
        Ok(operations::update_ruleset(&self.pool, &self.actor, spec, expected).await?.into())
    }
    async fn delete_ruleset(&self, name: &str, expected: i64) -> anyhow::Result<Outcome<()>> {
        Ok(operations::delete_ruleset(&self.pool, &self.actor, name, expected).await?.into())
    }
    async fn rulesets(&self) -> anyhow::Result<Vec<RulesetView>> {
        let mut conn = self.pool.acquire().await?;
        pages::local(self.page_size, None, async |r| store::ruleset_page(&mut conn, r).await).await
    }
    async fn ruleset(&self, name: &str) -> anyhow::Result<RulesetView> {
        Ok(store::ruleset_view(&mut *self.pool.acquire().await?, name).await?)
    }
    async fn stage_ruleset(&self, spec: &RulesetSpec) -> anyhow::Result<Outcome<i64>> {
        Ok(staged::stage(&self.pool, &self.actor, spec).await?.into())
    }
    async fn unstage_ruleset(&self, name: &str) -> anyhow::Result<Outcome<()>> {
        Ok(staged::unstage(&self.pool, &self.actor, name).await?.into())
    }
    async fn staged_rulesets(&self) -> anyhow::Result<Vec<StagedView>> {
        Ok(staged::list(&self.pool).await?)
    }
    async fn promote_staged(&self, request: &PromoteStaged) -> anyhow::Result<Outcome<StagedPromotion>> {
        Ok(staged::promote_staged(&self.pool, &self.actor, request).await?.into())
    }

    async fn render(&self) -> anyhow::Result<Outcome<()>> {
        Ok(authoring::render_audited(&self.pool, &self.actor).await?.into())
    }

    async fn create_test_set(&self, spec: &TestSetSpec) -> anyhow::Result<Outcome<i64>> {
        Ok(foresight::create_test_set(&self.pool, &self.actor, spec).await?.into())
    }
    async fn update_test_set(&self, spec: &TestSetSpec, expected: i64) -> anyhow::Result<Outcome<i64>> {
        Ok(foresight::update_test_set(&self.pool, &self.actor, spec, expected).await?.into())
    }
    async fn delete_test_set(&self, name: &str, expected: i64) -> anyhow::Result<Outcome<()>> {
        Ok(foresight::delete_test_set(&self.pool, &self.actor, name, expected).await?.into())
    }
    async fn test_sets(&self) -> anyhow::Result<Vec<TestSetRow>> {
        Ok(foresight::list_test_sets(&self.pool).await?)
    }
    async fn test_set(&self, name: &str) -> anyhow::Result<TestSetRow> {
        Ok(foresight::show_test_set(&self.pool, name).await?)
    }
    async fn run_tests(&self, draft: Option<&str>) -> anyhow::Result<RunReport> {
        Ok(match draft {
            Some(name) => drafts::run_tests(&self.pool, &self.actor, name, &CountBounds::default()).await?,
            None => foresight::run_policy_tests(&self.pool).await?,
        })
    }

    async fn add_estate_range(&self, range: Cidr, description: &str) -> anyhow::Result<Outcome<()>> {
        Ok(operations::add_estate_range(&self.pool, &self.actor, range, description).await?.into())
    }
    async fn remove_estate_range(&self, range: Cidr) -> anyhow::Result<Outcome<()>> {
        Ok(operations::remove_estate_range(&self.pool, &self.actor, range).await?.into())
    }
    async fn estate_ranges(&self) -> anyhow::Result<Vec<EstateRangeView>> {
        let mut conn = self.pool.acquire().await?;
        pages::local(self.page_size, None, async |r| store::estate_range_page(&mut conn, r).await).await
    }

    async fn management(&self) -> anyhow::Result<ManagementListing> {
        let mut conn = self.pool.acquire().await?;
        Ok(management::list(&mut conn).await?)
    }
    async fn narrow_management(
        &self,
        scope: ManagementScope,
        set: &Management,
    ) -> anyhow::Result<Outcome<()>> {
        Ok(management::narrow(&self.pool, &self.actor, scope, set).await?.into())
    }
    async fn reset_management(&self, set: &Management) -> anyhow::Result<Outcome<()>> {
        Ok(management::reset(&self.pool, &self.actor, set).await?.into())
    }

    async fn workloads(&self) -> anyhow::Result<Vec<WorkloadRow>> {
        let filter = store::WorkloadFilter { include_retired: true, ..Default::default() };
        let mut conn = self.pool.acquire().await?;
        pages::local(WORKLOAD_PAGE, None, async |r| store::workload_page(&mut conn, &filter, r).await).await
    }
    async fn workload(&self, id: WorkloadId) -> anyhow::Result<WorkloadView> {
        Ok(store::workload_view(&mut *self.pool.acquire().await?, id).await?)
    }
    async fn change_labels(
        &self,
        id: WorkloadId,
        expected: i64,
        set: &[Label],
        remove: &[LabelKey],
    ) -> anyhow::Result<Outcome<LabelsReplaced>> {
        Ok(operations::change_labels(&self.pool, &self.actor, id, expected, set, remove).await?.into())
    }
    async fn verdict(&self, scope: &ScopeArgs, evidence: &EvidenceArgs) -> anyhow::Result<Verdict> {
        Ok(gate::judge(&self.pool, &scope.scope()?, &evidence.params()?).await?)
    }
    async fn promote(
        &self,
        request: &gate::Request,
        _: &ScopeArgs,
        _: &EvidenceArgs,
    ) -> anyhow::Result<Promotion> {
        Ok(gate::promote(&self.pool, &self.actor, request).await?)
    }
    async fn sync_status(&self, id: Option<WorkloadId>) -> anyhow::Result<Vec<SyncStatusView>> {
        let mut conn = self.pool.acquire().await?;
        match id {
            Some(id) => Ok(vec![store::sync_status_of(&mut conn, id).await?]),
            None => {
                pages::local(WORKLOAD_PAGE, None, async |r| store::sync_status_page(&mut conn, r).await).await
            }
        }
    }
    async fn resend_snapshot(&self, id: WorkloadId) -> anyhow::Result<ResendRequested> {
        Ok(authoring::request_snapshot(&self.pool, &self.actor, id).await?)
    }
    async fn rollback(
        &self,
        scope: &Scope,
        _: &ScopeArgs,
        expect_count: usize,
        target: Target,
    ) -> anyhow::Result<Outcome<Vec<RolledBack>>> {
        Ok(rollback::rollback(&self.pool, &self.actor, scope, expect_count, target).await?.into())
    }
    async fn unpin(&self, id: WorkloadId) -> anyhow::Result<Outcome<()>> {
        Ok(rollback::unpin(&self.pool, &self.actor, id).await?.into())
    }
    async fn retire(&self, id: WorkloadId) -> anyhow::Result<Outcome<()>> {
        Ok(operations::retire(&self.pool, &self.actor, id).await?.into())
    }
    async fn deny(&self, id: WorkloadId) -> anyhow::Result<Outcome<()>> {
        Ok(operations::deny(&self.pool, &self.actor, id).await?.into())
    }
    async fn release_address(
        &self,
        id: WorkloadId,
        address: std::net::IpAddr,
    ) -> anyhow::Result<Outcome<()>> {
        Ok(operations::release_address(&self.pool, &self.actor, id, address).await?.into())
    }
    async fn policy(&self, id: WorkloadId) -> anyhow::Result<PolicyView> {
        Ok(store::policy_view(&mut *self.pool.acquire().await?, id).await?)
    }
    async fn replay(&self, id: WorkloadId, from: u64, to: u64, args: &ReplayArgs) -> anyhow::Result<Impact> {
        let range = args.range()?;
        let mut conn = self.pool.acquire().await?;
        Ok(foresight::replay(&mut conn, id, from, to, range, args.top).await?)
    }

    async fn create_draft(&self, name: &str, note: &str) -> anyhow::Result<DraftView> {
        Ok(drafts::create(&self.pool, &self.actor, name, note).await?)
    }
    async fn drafts(&self) -> anyhow::Result<Vec<DraftSummary>> {
        Ok(drafts::list(&self.pool).await?)
    }
    async fn draft(&self, name: &str) -> anyhow::Result<DraftView> {
        Ok(drafts::show(&self.pool, name).await?)
    }
    async fn add_to_draft(&self, name: &str, file: &ChangeFile) -> anyhow::Result<DraftView> {
        Ok(drafts::add(&self.pool, &self.actor, name, file, &CountBounds::default()).await?)
    }
    async fn render_draft(&self, name: &str) -> anyhow::Result<DraftRender> {
        Ok(drafts::render(&self.pool, &self.actor, name, &CountBounds::default()).await?)
    }
    async fn draft_impact(&self, name: &str, args: &ReplayArgs) -> anyhow::Result<DraftImpact> {
        let range = args.range()?;
        let counts = CountBounds::default();
        let (render, impact) =
            drafts::impact(&self.pool, &self.actor, name, &counts, range, args.top).await?;
        Ok(DraftImpact { render, impact })
    }
    async fn discard_draft(&self, name: &str, expected: i64) -> anyhow::Result<Outcome<()>> {
        drafts::discard(&self.pool, &self.actor, name, expected).await?;
        Ok(Outcome { result: (), changed: Vec::new() })
    }
    async fn commit_draft(&self, name: &str, expected: i64) -> anyhow::Result<Outcome<DraftCommitted>> {
        Ok(drafts::commit(&self.pool, &self.actor, name, expected, &CountBounds::default()).await?.into())
    }

    async fn suggestions(&self, args: &SuggestArgs) -> anyhow::Result<Suggestions> {
        Ok(suggest::run(&self.pool, &args.request()?).await?)
    }
    async fn accept_suggestions(&self, ids: &[String], draft: &str) -> anyhow::Result<Accepted> {
        Ok(suggest::accept(&self.pool, &self.actor, ids, draft, &CountBounds::default()).await?)
    }
    async fn ignore_suggestions(&self, ids: &[String]) -> anyhow::Result<()> {
        Ok(suggest::ignore(&self.pool, &self.actor, ids).await?)
    }

    async fn mint_token(
        &self,
        labels: &[Label],
        ttl: chrono::Duration,
        max_uses: Option<u32>,
        ranges: &[Cidr],
    ) -> anyhow::Result<Minted> {
        Ok(tokens::mint_audited(&self.pool, &self.actor, labels, ttl, max_uses, ranges).await?.into())
    }
    async fn tokens(&self) -> anyhow::Result<Vec<TokenView>> {
        let mut conn = self.pool.acquire().await?;
        pages::local(self.page_size, None, async |r| tokens::page(&mut conn, r).await).await
    }
    async fn revoke_token(&self, id: Uuid) -> anyhow::Result<()> {
        Ok(tokens::revoke_audited(&self.pool, &self.actor, id).await?)
    }

    async fn flow_records(&self, query: &RecordQuery, page: &PageRequest) -> anyhow::Result<Page<FlowRow>> {
        Ok(flows::list(&self.pool, &query.filter(), page).await?)
    }
    async fn flow_gaps(
        &self,
        workload: Option<WorkloadId>,
        since: Duration,
        page: &PageRequest,
    ) -> anyhow::Result<Page<GapRow>> {
        Ok(flows::gaps(&self.pool, workload, crate::duration::since(&since), page).await?)
    }
    async fn flow_rollup(&self, rollup: &Rollup, page: &PageRequest) -> anyhow::Result<Page<RollupRow>> {
        let mut filter = rollup.filter();
        if let Some((_, selector)) = &rollup.scope {
            filter = filter.within(flows::workloads_in(&self.pool, selector).await?);
        }
        Ok(flows::rollup(&self.pool, rollup.by, &filter, page).await?)
    }
    async fn scope_is_empty(&self, _: &str, selector: &Selector) -> anyhow::Result<bool> {
        Ok(flows::workloads_in(&self.pool, selector).await?.is_empty())
    }

    async fn promotions(&self, limit: Option<u32>) -> anyhow::Result<Vec<Promotion>> {
        let most = limit.map(|n| n as usize);
        let size = limit.map_or(self.page_size, |n| n.min(self.page_size));
        let mut conn = self.pool.acquire().await?;
        pages::local(size, most, async |r| gate::promote::page(&mut conn, r).await).await
    }
    async fn promotion(&self, id: Uuid) -> anyhow::Result<Promotion> {
        Ok(gate::promote::show(&mut *self.pool.acquire().await?, id).await?)
    }
    async fn confirm_promotion(&self, id: Uuid, override_reason: Option<&str>) -> anyhow::Result<Promotion> {
        Ok(confirm::confirm(&self.pool, &self.actor, id, override_reason).await?)
    }
    async fn audit(&self, query: &AuditQuery) -> anyhow::Result<Vec<AuditRow>> {
        let filter = query.filter();
        let mut conn = self.pool.acquire().await?;
        pages::local(self.page_size, None, async |r| audit::page(&mut conn, &filter, r).await).await
    }
}

/// A [`RulesetView`] from the API's JSON (the spec is flattened beside `version`).
fn ruleset_view(mut value: serde_json::Value) -> anyhow::Result<RulesetView> {
    let version = value.as_object_mut().and_then(|o| o.remove("version")).and_then(|v| v.as_i64());
    let Some(version) = version else { bail!("a ruleset in the answer has no version") };
    Ok(RulesetView { version, spec: serde_json::from_value(value)? })
}

impl Backend for ApiClient {
    async fn create<A: Catalog>(&self, args: &A) -> anyhow::Result<Outcome<()>> {
        args.spec()?;
        self.write("POST", A::PATH, None, Some(&args.body(true))).await
    }
    async fn update<A: Catalog>(&self, args: &A, expected: i64) -> anyhow::Result<Outcome<i64>> {
        args.spec()?;
        let path = format!("{}/{}", A::PATH, segment(args.arg_name()));
        self.write("PUT", &path, Some(expected), Some(&args.body(false))).await
    }
    async fn delete<A: Catalog>(&self, name: &str, expected: i64) -> anyhow::Result<Outcome<()>> {
        self.write("DELETE", &format!("{}/{}", A::PATH, segment(name)), Some(expected), None).await
    }
    async fn list<A: Catalog>(&self) -> anyhow::Result<Vec<A::View>> {
        pages::remote(self, A::PATH, None).await
    }
    async fn show<A: Catalog>(&self, name: &str) -> anyhow::Result<A::View> {
        self.get(&format!("{}/{}", A::PATH, segment(name))).await
    }

    async fn create_ruleset(&self, spec: &RulesetSpec) -> anyhow::Result<Outcome<()>> {
        self.write("POST", RULESETS, None, Some(&serde_json::to_value(spec)?)).await
    }
    async fn update_ruleset(&self, spec: &RulesetSpec, expected: i64) -> anyhow::Result<Outcome<i64>> {
        let path = format!("{RULESETS}/{}", segment(&spec.name));
        self.write("PUT", &path, Some(expected), Some(&serde_json::to_value(spec)?)).await
    }
    async fn delete_ruleset(&self, name: &str, expected: i64) -> anyhow::Result<Outcome<()>> {
        self.write("DELETE", &format!("{RULESETS}/{}", segment(name)), Some(expected), None).await
    }
    async fn rulesets(&self) -> anyhow::Result<Vec<RulesetView>> {
        let all: Vec<serde_json::Value> = pages::remote(self, RULESETS, None).await?;
        all.into_iter().map(ruleset_view).collect()
    }
    async fn ruleset(&self, name: &str) -> anyhow::Result<RulesetView> {
        ruleset_view(self.get(&format!("{RULESETS}/{}", segment(name))).await?)
    }
    async fn stage_ruleset(&self, spec: &RulesetSpec) -> anyhow::Result<Outcome<i64>> {
        self.write("POST", STAGED, None, Some(&serde_json::to_value(spec)?)).await
    }
    async fn unstage_ruleset(&self, name: &str) -> anyhow::Result<Outcome<()>> {
        self.write("DELETE", &format!("{STAGED}/{}", segment(name)), None, None).await
    }
    async fn staged_rulesets(&self) -> anyhow::Result<Vec<StagedView>> {
        self.get(STAGED).await
    }
    async fn promote_staged(&self, request: &PromoteStaged) -> anyhow::Result<Outcome<StagedPromotion>> {
        let body = serde_json::json!({
            "expect_count": request.expect_count,
            "min_evidence": humantime::format_duration(request.min_evidence).to_string(),
            "override_reason": request.override_reason,
        });
        self.write("POST", &format!("{STAGED}/{}/promote", segment(&request.name)), None, Some(&body)).await
    }

    async fn render(&self) -> anyhow::Result<Outcome<()>> {
        self.write("POST", "/api/v1/render", None, None).await
    }

    async fn create_test_set(&self, spec: &TestSetSpec) -> anyhow::Result<Outcome<i64>> {
        self.write("POST", TEST_SETS, None, Some(&serde_json::to_value(spec)?)).await
    }
    async fn update_test_set(&self, spec: &TestSetSpec, expected: i64) -> anyhow::Result<Outcome<i64>> {
        let path = format!("{TEST_SETS}/{}", segment(&spec.name));
        self.write("PUT", &path, Some(expected), Some(&serde_json::to_value(spec)?)).await
    }
    async fn delete_test_set(&self, name: &str, expected: i64) -> anyhow::Result<Outcome<()>> {
        self.write("DELETE", &format!("{TEST_SETS}/{}", segment(name)), Some(expected), None).await
    }
    async fn test_sets(&self) -> anyhow::Result<Vec<TestSetRow>> {
        self.get(TEST_SETS).await
    }
    async fn test_set(&self, name: &str) -> anyhow::Result<TestSetRow> {
        self.get(&format!("{TEST_SETS}/{}", segment(name))).await
    }
    async fn run_tests(&self, draft: Option<&str>) -> anyhow::Result<RunReport> {
        let path = match draft {
            Some(name) => format!("/api/v1/drafts/{}/tests", segment(name)),
            None => "/api/v1/policy-tests/run".to_owned(),
        };
        self.write("POST", &path, None, None).await
    }

    async fn add_estate_range(&self, range: Cidr, description: &str) -> anyhow::Result<Outcome<()>> {
        let body = serde_json::json!({"cidr": range.to_string(), "description": description});
        self.write("POST", ESTATE_RANGES, None, Some(&body)).await
    }
    async fn remove_estate_range(&self, range: Cidr) -> anyhow::Result<Outcome<()>> {
        let net = range.net();
        let path = format!("{ESTATE_RANGES}/{}/{}", segment(&net.network().to_string()), net.prefix_len());
        self.write("DELETE", &path, None, None).await
    }
    async fn estate_ranges(&self) -> anyhow::Result<Vec<EstateRangeView>> {
        pages::remote(self, ESTATE_RANGES, None).await
    }

    async fn management(&self) -> anyhow::Result<ManagementListing> {
        self.get(MANAGEMENT).await
    }
    async fn narrow_management(
        &self,
        scope: ManagementScope,
        set: &Management,
    ) -> anyhow::Result<Outcome<()>> {
        let path = match scope {
            ManagementScope::Estate => MANAGEMENT.to_owned(),
            ManagementScope::Workload(id) => format!("{}/management", workload(id)),
        };
        let cidrs: Vec<String> = set.cidrs().iter().map(ToString::to_string).collect();
        let services: Vec<String> = set.services().iter().map(ToString::to_string).collect();
        let body = serde_json::json!({"cidrs": cidrs, "services": services});
        self.write("PUT", &path, None, Some(&body)).await
    }
    async fn reset_management(&self, _: &Management) -> anyhow::Result<Outcome<()>> {
        bail!(
            "`innerwall management reset` replaces the estate's management access on the database only; run it on the control-plane host without --api"
        )
    }

    async fn workloads(&self) -> anyhow::Result<Vec<WorkloadRow>> {
        pages::remote_sized(self, "/api/v1/workloads?include_retired=true", WORKLOAD_PAGE).await
    }
    async fn workload(&self, id: WorkloadId) -> anyhow::Result<WorkloadView> {
        /// The part of `GET /api/v1/workloads/{id}` that `workload show` prints.
        #[derive(serde::Deserialize)]
        struct Detail {
            workload: WorkloadView,
        }
        Ok(self.get::<Detail>(&workload(id)).await?.workload)
    }
    async fn change_labels(
        &self,
        id: WorkloadId,
        expected: i64,
        set: &[Label],
        remove: &[LabelKey],
    ) -> anyhow::Result<Outcome<LabelsReplaced>> {
        authoring::check_label_edit(set, remove)?;
        let path = format!("{}/labels", workload(id));
        let read: Labels = self.get(&path).await?;
        // The new set is computed from the labels read, so it is only sent conditioned on the
        // version read; a newer version named than the one read cannot be current.
        if read.version < expected {
            bail!(authoring::stale_labels(id, expected, read.version));
        }
        let mut labels: BTreeMap<String, String> = read.labels;
        for key in remove {
            labels.remove(key.as_str());
        }
        for label in set {
            labels.insert(label.key.to_string(), label.value.to_string());
        }
        let body = serde_json::json!({ "labels": labels });
        self.write("PUT", &path, Some(expected), Some(&body)).await
    }
    async fn verdict(&self, scope: &ScopeArgs, evidence: &EvidenceArgs) -> anyhow::Result<Verdict> {
        scope.scope()?;
        evidence.params()?;
        if scope.ids.len() > MAX_QUERY_IDS {
            bail!(
                "{} --id flags: with --api a verdict names at most {MAX_QUERY_IDS} workloads by id (they travel in the URL); name more with --scope",
                scope.ids.len()
            );
        }
        let (since, min) = evidence.texts();
        let mut query = vec![("evidence_since", since), ("min_evidence", min)];
        match &scope.scope {
            Some(text) => query.push(("scope", text.clone())),
            None => {
                let ids: Vec<String> = scope.ids.iter().map(ToString::to_string).collect();
                query.push(("ids", ids.join(",")));
            }
        }
        self.get(&with_query("/api/v1/verdict", &query)).await
    }
    async fn promote(
        &self,
        request: &gate::Request,
        scope: &ScopeArgs,
        evidence: &EvidenceArgs,
    ) -> anyhow::Result<Promotion> {
        let (since, min) = evidence.texts();
        let ids: Vec<String> = scope.ids.iter().map(ToString::to_string).collect();
        let body = serde_json::json!({
            "scope": scope.scope,
            "ids": if scope.scope.is_some() { Vec::new() } else { ids },
            "expect_count": request.expect_count,
            "to": request.to.name(),
            "reason": request.reason,
            "override_reason": request.override_reason,
            "evidence_since": since,
            "min_evidence": min,
            "guard": request.guard,
            "confirm_within": request.confirm_within.map(|d| humantime::format_duration(d).to_string()),
        });
        self.write("POST", "/api/v1/promotions", None, Some(&body)).await
    }
    async fn sync_status(&self, id: Option<WorkloadId>) -> anyhow::Result<Vec<SyncStatusView>> {
        match id {
            Some(id) => Ok(vec![self.get(&format!("/api/v1/sync-status/{id}")).await?]),
            None => pages::remote_sized(self, "/api/v1/sync-status", WORKLOAD_PAGE).await,
        }
    }
    async fn rollback(
        &self,
        _: &Scope,
        args: &ScopeArgs,
        expect_count: usize,
        target: Target,
    ) -> anyhow::Result<Outcome<Vec<RolledBack>>> {
        let ids: Vec<String> = args.ids.iter().map(ToString::to_string).collect();
        let body = serde_json::json!({
            "scope": args.scope,
            "ids": if args.scope.is_some() { Vec::new() } else { ids },
            "expect_count": expect_count,
            "to_version": match target { Target::Version(v) => Some(v), Target::LastClean => None },
        });
        self.write("POST", "/api/v1/rollbacks", None, Some(&body)).await
    }
    async fn unpin(&self, id: WorkloadId) -> anyhow::Result<Outcome<()>> {
        self.write("POST", &format!("{}/unpin", workload(id)), None, None).await
    }
    async fn resend_snapshot(&self, id: WorkloadId) -> anyhow::Result<ResendRequested> {
        self.write("POST", &format!("{}/resend-snapshot", workload(id)), None, None).await
    }
    async fn retire(&self, id: WorkloadId) -> anyhow::Result<Outcome<()>> {
        self.write("POST", &format!("{}/retire", workload(id)), None, None).await
    }
    async fn deny(&self, id: WorkloadId) -> anyhow::Result<Outcome<()>> {
        self.write("POST", &format!("{}/deny", workload(id)), None, None).await
    }
    async fn release_address(
        &self,
        id: WorkloadId,
        address: std::net::IpAddr,
    ) -> anyhow::Result<Outcome<()>> {
        let body = serde_json::json!({ "address": address.to_string() });
        self.write("POST", &format!("{}/release-address", workload(id)), None, Some(&body)).await
    }
    async fn policy(&self, id: WorkloadId) -> anyhow::Result<PolicyView> {
        self.get(&format!("{}/policy", workload(id))).await
    }
    async fn replay(&self, id: WorkloadId, from: u64, to: u64, args: &ReplayArgs) -> anyhow::Result<Impact> {
        args.range()?;
        let query = [
            ("from", from.to_string()),
            ("to", to.to_string()),
            ("since", crate::duration::since_param(&args.since)),
            ("top", args.top.to_string()),
        ];
        self.get(&with_query(&format!("{}/replay", workload(id)), &query)).await
    }

    async fn create_draft(&self, name: &str, note: &str) -> anyhow::Result<DraftView> {
        self.write("POST", DRAFTS, None, Some(&serde_json::json!({"name": name, "note": note}))).await
    }
    async fn drafts(&self) -> anyhow::Result<Vec<DraftSummary>> {
        self.get(DRAFTS).await
    }
    async fn draft(&self, name: &str) -> anyhow::Result<DraftView> {
        self.get(&draft(name)).await
    }
    async fn add_to_draft(&self, name: &str, file: &ChangeFile) -> anyhow::Result<DraftView> {
        let body = serde_json::to_value(file)?;
        self.write("POST", &format!("{}/changes", draft(name)), None, Some(&body)).await
    }
    async fn render_draft(&self, name: &str) -> anyhow::Result<DraftRender> {
        self.get(&format!("{}/render", draft(name))).await
    }
    async fn draft_impact(&self, name: &str, args: &ReplayArgs) -> anyhow::Result<DraftImpact> {
        args.range()?;
        let query = [("since", crate::duration::since_param(&args.since)), ("top", args.top.to_string())];
        self.write("POST", &with_query(&format!("{}/impact", draft(name)), &query), None, None).await
    }
    async fn discard_draft(&self, name: &str, expected: i64) -> anyhow::Result<Outcome<()>> {
        self.write("DELETE", &draft(name), Some(expected), None).await
    }
    async fn commit_draft(&self, name: &str, expected: i64) -> anyhow::Result<Outcome<DraftCommitted>> {
        self.write("POST", &format!("{}/commit", draft(name)), Some(expected), None).await
    }

    async fn suggestions(&self, args: &SuggestArgs) -> anyhow::Result<Suggestions> {
        self.get(&with_query(SUGGESTIONS, &args.query()?)).await
    }
    async fn accept_suggestions(&self, ids: &[String], draft: &str) -> anyhow::Result<Accepted> {
        let body = serde_json::json!({"ids": ids, "draft": draft});
        self.write("POST", &format!("{SUGGESTIONS}/accept"), None, Some(&body)).await
    }
    async fn ignore_suggestions(&self, ids: &[String]) -> anyhow::Result<()> {
        let body = serde_json::json!({"ids": ids});
        let _: serde_json::Value =
            self.write("POST", &format!("{SUGGESTIONS}/ignore"), None, Some(&body)).await?;
        Ok(())
    }

    async fn mint_token(
        &self,
        labels: &[Label],
        ttl: chrono::Duration,
        max_uses: Option<u32>,
        ranges: &[Cidr],
    ) -> anyhow::Result<Minted> {
        let body = serde_json::json!({
            "labels": labels.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "ttl_seconds": ttl.num_seconds(),
            "max_uses": max_uses,
            "address_ranges": ranges.iter().map(ToString::to_string).collect::<Vec<_>>(),
        });
        self.write("POST", TOKENS, None, Some(&body)).await
    }
    async fn tokens(&self) -> anyhow::Result<Vec<TokenView>> {
        pages::remote(self, TOKENS, None).await
    }
    async fn revoke_token(&self, id: Uuid) -> anyhow::Result<()> {
        let _: TokenView = self.write("DELETE", &format!("{TOKENS}/{id}"), None, None).await?;
        Ok(())
    }

    async fn flow_records(&self, query: &RecordQuery, page: &PageRequest) -> anyhow::Result<Page<FlowRow>> {
        self.get(&query.path(page)).await
    }
    async fn flow_gaps(
        &self,
        workload: Option<WorkloadId>,
        since: Duration,
        page: &PageRequest,
    ) -> anyhow::Result<Page<GapRow>> {
        self.get(&gaps_path(workload, &since, page)).await
    }
    async fn flow_rollup(&self, rollup: &Rollup, page: &PageRequest) -> anyhow::Result<Page<RollupRow>> {
        self.get(&rollup.query(page)).await
    }
    async fn scope_is_empty(&self, text: &str, _: &Selector) -> anyhow::Result<bool> {
        // The API resolves a scope itself; whether it holds anyone is asked as the fleet list
        // answers it (live workloads the selector matches now).
        let path =
            with_query("/api/v1/workloads", &[("selector", text.to_owned()), ("limit", "1".to_owned())]);
        let fleet: serde_json::Value = self.get(&path).await?;
        Ok(fleet["rows"].as_array().is_none_or(Vec::is_empty))
    }

    async fn promotions(&self, limit: Option<u32>) -> anyhow::Result<Vec<Promotion>> {
        pages::remote(self, "/api/v1/promotions", limit.map(|n| n as usize)).await
    }
    async fn promotion(&self, id: Uuid) -> anyhow::Result<Promotion> {
        self.get(&format!("/api/v1/promotions/{id}")).await
    }
    async fn confirm_promotion(&self, id: Uuid, override_reason: Option<&str>) -> anyhow::Result<Promotion> {
        let body = serde_json::json!({ "override_reason": override_reason });
        self.write("POST", &format!("/api/v1/promotions/{id}/confirm"), None, Some(&body)).await
    }
    async fn audit(&self, query: &AuditQuery) -> anyhow::Result<Vec<AuditRow>> {
        pages::remote(self, &query.path(), None).await
    }
}
