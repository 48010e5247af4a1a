//! The one operator commit (`commit`): `policy::authoring::commit_checked` with the policy tests
//! as its check, so every operator change (CLI, API) is refused, writing nothing, when it breaks
//! a test. Also the stored test sets (table `policy_test_sets`, versioned like rulesets, each
//! change itself a checked commit) and the on-demand run.

use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool, Row};
use uuid::Uuid;

use crate::error::Error;
use crate::foresight::impact::{self, Range};
use crate::foresight::policy_tests::{
    self, MAX_OBSERVED_TESTS, MAX_PAIRS, MAX_TEST_SETS, Observations, Replay, RunReport, TestSetSpec,
};
use crate::policy::authoring::{self, Committed};
use crate::policy::publish::{Overflow, Rendering, Touched, publish_rendering};

/// Runs `change`, renders, evaluates every policy test on the rendering, audits and commits,
/// in one transaction: a change that makes any test fail is refused with
/// [`Error::PolicyTestsFailed`] (every failure) and writes nothing (no version, no audit row, no
/// notice). The one commit for operator changes.
pub async fn commit<T>(
    pool: &PgPool,
    actor: &str,
    action: &str,
    subject: &str,
    change: impl AsyncFnOnce(&mut PgConnection) -> Result<(T, serde_json::Value), Error>,
) -> Result<Committed<T>, Error> {
    commit_touching(pool, actor, action, subject, &[], change).await
}

/// [`commit`] of a change that touched only `touched` (a label edit): rendered narrowed to the
/// workloads it can touch (POL-7) unless policy tests exist, which judge the whole estate.
pub async fn commit_touching<T>(
    pool: &PgPool,
    actor: &str,
    action: &str,
    subject: &str,
    touched: &[Touched],
    change: impl AsyncFnOnce(&mut PgConnection) -> Result<(T, serde_json::Value), Error>,
) -> Result<Committed<T>, Error> {
    authoring::commit_checked_touching(pool, actor, action, subject, touched, change, check).await
}

/// The check of [`commit`]: all stored sets over `rendering`.
async fn check(conn: &mut PgConnection, rendering: &Rendering) -> Result<(), Error> {
    let failures = judge(conn, rendering).await?.failures();
    if failures.is_empty() { Ok(()) } else { Err(Error::PolicyTestsFailed(failures)) }
}

/// Every stored test judged over `rendering`, inside the caller's transaction (a commit's check,
/// an on-demand run, a draft's run): the `observed` tests' recorded flows are replayed here
/// (`foresight::impact`, one replay per distinct range, ending now), then every test is judged
/// by the pure `policy_tests::evaluate`. A replay that cannot be made (over
/// `foresight::impact::MAX_KEYS` flow keys, over its workload bound) is an invalid change
/// naming the tests, and more than [`MAX_OBSERVED_TESTS`] `observed` tests across the sets is
/// over its bound: either way the commit writes nothing.
pub(crate) async fn judge(conn: &mut PgConnection, rendering: &Rendering) -> Result<RunReport, Error> {
    let sets = load_sets(conn).await?;
    if rendering.narrowed && !sets.is_empty() {
        // `publish_touched` renders everything when a test set exists: this cannot happen.
        return Err(Error::Corrupt {
            what: "render",
            detail: "policy tests were asked to judge a narrowed render".into(),
        });
    }
    judge_sets(conn, &sets, rendering).await
}

/// [`judge`] of the sets given rather than the stored ones (checked by
/// `policy_tests::check_set`), inside the caller's transaction.
pub async fn judge_sets(
    conn: &mut PgConnection,
    sets: &[TestSetSpec],
    rendering: &Rendering,
) -> Result<RunReport, Error> {
    if sets.is_empty() {
        return Ok(RunReport { results: Vec::new() });
    }
    // Checked here, under the render lock every commit takes, so concurrent set changes cannot
    // both pass it.
    let observed: usize = sets.iter().map(policy_tests::observed_count).sum();
    if observed > MAX_OBSERVED_TESTS {
        return Err(Error::OverBound {
            what: "observed policy tests across all test sets",
            limit: MAX_OBSERVED_TESTS as u64,
            bound: "foresight::policy_tests::MAX_OBSERVED_TESTS",
            remedy: "merge observed tests (one test may select many workloads) or delete some",
        });
    }
    let mut observations = Observations::new();
    let now = chrono::Utc::now();
    for replay in policy_tests::replays(sets, rendering) {
        let observed = async {
            let range = Range::ending_at(now, replay.since)?;
            impact::impact(conn, &replay.proposed, range, MAX_PAIRS).await
        };
        let impact = observed.await.map_err(|e| unjudgeable(&replay, e))?;
        observations.insert(replay.since, impact);
    }
    Ok(policy_tests::evaluate(sets, rendering, &observations))
}

/// An impact refusal as the refusal of the change that asked for it (other errors unchanged).
fn unjudgeable(replay: &Replay, e: Error) -> Error {
    match e {
        Error::Invalid(why) => Error::Invalid(format!(
            "observed policy test(s) {} (since {}) cannot be judged: {why}; shorten their since or narrow their to",
            replay.tests.join(", "),
            humantime::format_duration(replay.since)
        )),
        other => other,
    }
}

async fn load_sets(conn: &mut PgConnection) -> Result<Vec<TestSetSpec>, Error> {
    let rows: Vec<(String, serde_json::Value)> =
        sqlx::query_as("SELECT name, spec FROM policy_test_sets ORDER BY name").fetch_all(&mut *conn).await?;
    rows.into_iter()
        .map(|(name, spec)| {
            serde_json::from_value(spec)
                .map_err(|e| Error::Corrupt { what: "policy test set", detail: format!("{name}: {e}") })
        })
        .collect()
}

/// A stored test set, as `test-set list|show` and the API answer it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TestSetRow {
    pub name: String,
    pub description: String,
    pub version: i64,
    pub tests: usize,
    pub created_at: chrono::DateTime<chrono::Utc>,
    pub updated_at: chrono::DateTime<chrono::Utc>,
    pub spec: TestSetSpec,
}

fn detail(spec: &TestSetSpec) -> serde_json::Value {
    serde_json::json!({ "tests": spec.tests.len(), "description": spec.description })
}

/// Creates a test set (version 1) in a checked commit: a set whose tests fail now is refused.
pub async fn create_test_set(
    pool: &PgPool,
    actor: &str,
    spec: &TestSetSpec,
) -> Result<Committed<i64>, Error> {
    policy_tests::check_set(spec)?;
    commit(pool, actor, "policy-test-set.create", &spec.name, async |c| {
        let count: i64 =
            sqlx::query_scalar("SELECT count(*) FROM policy_test_sets").fetch_one(&mut *c).await?;
        if count as usize >= MAX_TEST_SETS {
            return Err(Error::OverBound {
                what: "policy test sets",
                limit: MAX_TEST_SETS as u64,
                bound: "foresight::policy_tests::MAX_TEST_SETS",
                remedy: "delete a set or merge sets",
            });
        }
        let done = sqlx::query(
            "INSERT INTO policy_test_sets (id, name, description, spec) VALUES ($1, $2, $3, $4)
             ON CONFLICT (name) DO NOTHING",
        )
        .bind(Uuid::new_v4())
        .bind(&spec.name)
        .bind(&spec.description)
        .bind(serde_json::to_value(spec).expect("plain data serializes"))
        .execute(&mut *c)
        .await?;
        if done.rows_affected() == 0 {
            return Err(Error::Exists { what: "policy test set", name: spec.name.clone() });
        }
        Ok((1, detail(spec)))
    })
    .await
}

async fn lock_set(c: &mut PgConnection, name: &str, expected: i64) -> Result<i64, Error> {
    let current: i64 = sqlx::query_scalar("SELECT version FROM policy_test_sets WHERE name = $1 FOR UPDATE")
        .bind(name)
        .fetch_optional(&mut *c)
        .await?
        .ok_or_else(|| Error::NotFound { what: "policy test set", name: name.to_owned() })?;
    if current != expected {
        return Err(Error::Stale { what: "policy test set", name: name.to_owned(), expected, current });
    }
    Ok(current)
}

/// Replaces a test set read at version `expected` (its version advances by one), checked.
pub async fn update_test_set(
    pool: &PgPool,
    actor: &str,
    spec: &TestSetSpec,
    expected: i64,
) -> Result<Committed<i64>, Error> {
    policy_tests::check_set(spec)?;
    commit(pool, actor, "policy-test-set.update", &spec.name, async |c| {
        let current = lock_set(c, &spec.name, expected).await?;
        sqlx::query(
            "UPDATE policy_test_sets SET spec = $2, description = $3, version = version + 1, updated_at = now()
             WHERE name = $1",
        )
        .bind(&spec.name)
        .bind(serde_json::to_value(spec).expect("plain data serializes"))
        .bind(&spec.description)
        .execute(&mut *c)
        .await?;
        Ok((current + 1, detail(spec)))
    })
    .await
}

/// Deletes a test set read at version `expected` (the remaining sets still judge the commit).
pub async fn delete_test_set(
    pool: &PgPool,
    actor: &str,
    name: &str,
    expected: i64,
) -> Result<Committed<()>, Error> {
    commit(pool, actor, "policy-test-set.delete", name, async |c| {
        lock_set(c, name, expected).await?;
        sqlx::query("DELETE FROM policy_test_sets WHERE name = $1").bind(name).execute(&mut *c).await?;
        Ok(((), serde_json::json!({})))
    })
    .await
}

fn row_of(row: sqlx::postgres::PgRow) -> Result<TestSetRow, Error> {
    let name: String = row.get("name");
    let spec: TestSetSpec = serde_json::from_value(row.get("spec"))
        .map_err(|e| Error::Corrupt { what: "policy test set", detail: format!("{name}: {e}") })?;
    Ok(TestSetRow {
        description: row.get("description"),
        version: row.get("version"),
        tests: spec.tests.len(),
        created_at: row.get("created_at"),
        updated_at: row.get("updated_at"),
        name,
        spec,
    })
}

/// Every test set, by name (at most [`MAX_TEST_SETS`]).
pub async fn list_test_sets(pool: &PgPool) -> Result<Vec<TestSetRow>, Error> {
    sqlx::query(
        "SELECT name, description, spec, version, created_at, updated_at FROM policy_test_sets ORDER BY name",
    )
    .fetch_all(pool)
    .await?
    .into_iter()
    .map(row_of)
    .collect()
}

/// One test set.
pub async fn show_test_set(pool: &PgPool, name: &str) -> Result<TestSetRow, Error> {
    let row = sqlx::query(
        "SELECT name, description, spec, version, created_at, updated_at FROM policy_test_sets WHERE name = $1",
    )
    .bind(name)
    .fetch_optional(pool)
    .await?
    .ok_or_else(|| Error::NotFound { what: "policy test set", name: name.to_owned() })?;
    row_of(row)
}

/// Runs every test on the estate as a commit would render it now, writing nothing: the render
/// happens inside a transaction that is rolled back (so no version, no notice persists).
pub async fn run_policy_tests(pool: &PgPool) -> Result<RunReport, Error> {
    let mut tx = pool.begin().await?;
    let rendering = publish_rendering(&mut tx, Overflow::Hold).await?;
    let report = judge(&mut tx, &rendering).await?;
    tx.rollback().await?;
    Ok(report)
}
