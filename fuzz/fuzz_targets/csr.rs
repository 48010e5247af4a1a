//! A CSR from an enrolling host: parsing and issuance never panic, and an issued certificate
//! names exactly the workload it was issued for.
#![no_main]

use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

use innerwall_control_plane::identity::ca::{FileCa, Signer, workload_id_from_certificate};
use innerwall_wire::identity::WorkloadId;
use libfuzzer_sys::fuzz_target;

fn ca() -> &'static FileCa {
    static CA: OnceLock<FileCa> = OnceLock::new();
    CA.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("iw-fuzz-ca-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ca = FileCa::init(&dir).expect("a CA for fuzzing");
        // Issuing reads only the root held in memory; libFuzzer ends the process with `exit`,
        // which runs no destructor, so the directory goes now.
        let _ = std::fs::remove_dir_all(&dir);
        ca
    })
}

fuzz_target!(|data: &[u8]| {
    let id = WorkloadId::new_random();
    if let Ok(issued) = ca().issue_workload(id, data, Duration::from_secs(3600), SystemTime::now()) {
        let (_, pem) =
            x509_parser::pem::parse_x509_pem(issued.pem.as_bytes()).expect("an issued certificate is PEM");
        assert_eq!(workload_id_from_certificate(&pem.contents).ok(), Some(id));
    }
});
