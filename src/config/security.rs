//! Security: TLS for gRPC and the subscribers' bearer token, read and checked into the secrets'
//! settings ([`SecurityConfig`]).

use std::path::PathBuf;

use serde::Deserialize;

use super::{invalid, ConfigError, Merge};
use crate::secrets::{read_tls_files, read_token, SecretFiles, SecurityConfig};

concern! {
    /// Security: TLS for gRPC and the subscribers' bearer token.
    #[command(next_help_heading = "Security")]
    pub struct SecurityArgs {
        /// TLS certificate chain (PEM) for gRPC; needs `--tls-key`.
        #[arg(long, value_name = "FILE")]
        pub tls_cert: Option<PathBuf>,
        /// TLS private key (PEM) for gRPC; needs `--tls-cert`.
        #[arg(long, value_name = "FILE")]
        pub tls_key: Option<PathBuf>,
        /// File holding the bearer token gRPC subscribers must send (`authorization: Bearer …`);
        /// the env var KVBRIDGE_AUTH_TOKEN is the alternative. The token is never a flag value.
        #[arg(long, value_name = "FILE")]
        pub auth_token_file: Option<PathBuf>,
    }
}

impl SecurityArgs {
    /// Reads the PEM files and the token (file, else the environment).
    pub(super) fn validate(self) -> Result<SecurityConfig, ConfigError> {
        let files = SecretFiles {
            tls: self.tls_cert.clone().zip(self.tls_key.clone()),
            token: self.auth_token_file.clone(),
        };
        let tls = match (self.tls_cert, self.tls_key) {
            (None, None) => None,
            (Some(c), Some(k)) => Some(read_tls_files(&c, &k)?),
            (Some(_), None) => {
                return Err(invalid("--tls-cert needs --tls-key (give both or neither)"))
            }
            (None, Some(_)) => {
                return Err(invalid("--tls-key needs --tls-cert (give both or neither)"))
            }
        };
        Ok(SecurityConfig {
            tls,
            auth_token: read_token(self.auth_token_file.as_deref())?,
            files,
        })
    }
}
