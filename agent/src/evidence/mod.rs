//! Flow evidence below the running loop: the host's interfaces as they come and go
//! ([`links`]), the eBPF capture that follows them and is drained ([`capture`]), the pure flow
//! windows a drain is absorbed into and closed as ([`flows`]), and the on-disk queue and upload
//! of closed windows on their own connection ([`telemetry`]). The loop that ties them to the
//! applied policy is `crate::daemon::windows`.

pub mod capture;
pub mod flows;
pub mod links;
pub mod telemetry;
