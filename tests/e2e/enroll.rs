//! `innerwall-agent enroll --force` through the agent's own enrollment path against a replica
//! over real mTLS (issue 16 item 3): what becomes of the workload a re-enrollment replaces.

use std::time::{Duration, SystemTime};

use innerwall_agent::identity::credential::{Credential, new_key_and_csr};
use innerwall_agent::identity::enroll::{EnrollError, EnrollOptions, Enrollment, Replaced};
use innerwall_control_plane::identity::ca::Signer;
use innerwall_wire::identity::WorkloadId;

use crate::plane::Plane;

/// One host enrolls, then re-enrolls: with `--force` its old workload is retired (proven by
/// the old credential); with `--keep-replaced` it stays live and the warning names it; with an
/// old credential that proves nothing (expired) enrollment goes on, the old workload stays live
/// and the warning tells the operator how to retire it.
#[tokio::test]
async fn enroll_force_retires_the_replaced_workload_unless_kept() {
    let plane = Plane::start().await;
    let state = plane.dir.join("host");
    let ca = plane.signer.ca_bundle_pem();
    let enroll = async |options: EnrollOptions| -> Result<Enrollment, EnrollError> {
        let token = plane.mint(&["app=web"]).await;
        innerwall_agent::identity::enroll::enroll(&plane.server(), &token, &ca, &state, options).await
    };
    let live = async |id: WorkloadId| -> bool {
        sqlx::query_scalar("SELECT retired_at IS NULL FROM workloads WHERE id = $1")
            .bind(id.uuid())
            .fetch_one(plane.pool())
            .await
            .unwrap()
    };
    let force = EnrollOptions { force: true, keep_replaced: false };

    let first = enroll(EnrollOptions::default()).await.unwrap();
    assert_eq!(first.replaced, Replaced::Nothing);
    let first = first.credential.id;
    let refused = enroll(EnrollOptions::default()).await.unwrap_err();
    assert!(matches!(refused, EnrollError::AlreadyEnrolled { .. }), "{refused}");

    let second = enroll(force).await.unwrap();
    let second_id = second.credential.id;
    assert_eq!(second.replaced, Replaced::Retired(first));
    assert_eq!(second.replaced.warning(), None);
    assert_eq!((live(first).await, live(second_id).await), (false, true));
    assert_eq!(Credential::load(&state).unwrap().id, second_id, "the new identity is stored");

    let third = enroll(EnrollOptions { force: true, keep_replaced: true }).await.unwrap();
    let third_id = third.credential.id;
    assert_eq!(third.replaced, Replaced::Kept(Some(second_id)));
    let warning = third.replaced.warning().unwrap();
    assert!(warning.contains(&format!("`innerwall workload retire {second_id}`")), "{warning}");
    assert_eq!((live(second_id).await, live(third_id).await), (true, true));

    // The stored credential has expired: it cannot prove anything, so nothing is retired.
    let (key_pem, csr_pem) = new_key_and_csr().unwrap();
    let long_ago = SystemTime::now() - Duration::from_secs(7200);
    let expired =
        plane.signer.issue_workload(third_id, &csr_pem, Duration::from_secs(3600), long_ago).unwrap();
    Credential::new(key_pem, expired.pem, ca.clone()).unwrap().save(&state).unwrap();
    let fourth = enroll(force).await.unwrap();
    let Replaced::Unproven { id, why } = &fourth.replaced else { panic!("{:?}", fourth.replaced) };
    assert_eq!((*id, why.as_str()), (Some(third_id), "its certificate has expired"));
    let warning = fourth.replaced.warning().unwrap();
    assert!(warning.contains(&format!("`innerwall workload retire {third_id}`")), "{warning}");
    assert_eq!((live(third_id).await, live(fourth.credential.id).await), (true, true));
}
