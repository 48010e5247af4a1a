//! Who this host is and how it reaches the control plane: the credential in the state directory
//! and its TLS configs ([`credential`]), the one way a channel is dialed ([`connect`]), the host
//! facts it reports about itself ([`facts`]), and `innerwall-agent enroll` ([`enroll`]).
//! Renewal, which needs the running agent's shared state (`crate::sync::Agent`), is `crate::daemon::renew`.

pub mod connect;
pub mod credential;
pub mod enroll;
pub mod facts;
