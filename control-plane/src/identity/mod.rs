//! Identity (IDN-1..IDN-8): the CA, provisioning tokens, enrollment and renewal, and the one
//! agent listener whose handshake decides who a connection is, and the operator tokens of the HTTP
//! API.

pub mod ca;
pub mod clones;
pub mod enroll;
pub mod listener;
pub mod operators;
pub mod rotation;
pub mod server_cert;
pub mod tokens;
