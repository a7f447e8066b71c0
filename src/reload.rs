//! Changing the catalogue without a restart: [`CatalogueReloader`] reads the catalogue again
//! (from the file, as at start), checks it as at start, points the upstreams at what it names
//! and serves it, or refuses it whole and keeps serving the one before. Calls under way finish
//! on the catalogue they began with, at the price they reserved. The example gateway reloads
//! on `SIGHUP` and on `POST /admin/catalogue/reload`.
//!
//! ```
//! use std::sync::Arc;
//! use model_gateway::catalogue::{Catalogue, LiveCatalogue};
//! use model_gateway::reload::CatalogueReloader;
//! use model_gateway::{upstream::MockUpstream, Upstream};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let live = LiveCatalogue::from(Catalogue::demo());
//! let reloader = CatalogueReloader::new(live.clone(), Upstream::Mock(MockUpstream::new()), || {
//!     Catalogue::from_toml("[[upstreams]]\nname = \"oops\"") // a bad file
//! });
//! assert!(reloader.reload().await.is_err());
//! assert!(live.current().model("gpt-4o-mini").is_some()); // the old one serves on
//! # }
//! ```

use std::sync::Arc;

use crate::catalogue::{Catalogue, CatalogueError, LiveCatalogue, StartOnlySetting};
use crate::upstream::Upstream;

/// Where a reload reads the catalogue from.
type Load = Arc<dyn Fn() -> Result<Catalogue, CatalogueError> + Send + Sync>;

/// Reloads the catalogue a gateway serves; see the module docs. Cheap to clone.
#[derive(Clone)]
pub struct CatalogueReloader {
    live: LiveCatalogue,
    upstream: Upstream,
    load: Load,
    /// One reload at a time, so that two cannot cross between the check and the swap.
    running: Arc<tokio::sync::Mutex<()>>,
}

impl std::fmt::Debug for CatalogueReloader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CatalogueReloader")
            .field("live", &self.live)
            .finish_non_exhaustive()
    }
}

/// Why a reload was refused; the catalogue served before stays.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The new catalogue is not valid: the same message as at start.
    #[error(transparent)]
    Invalid(#[from] CatalogueError),
    /// It changes a setting read at start.
    #[error(transparent)]
    StartOnly(#[from] StartOnlySetting),
    /// An upstream's client could not be built (a proxy URL that is not one).
    #[error("cannot build an upstream's HTTP client: {0}")]
    Upstream(#[from] reqwest::Error),
}

impl CatalogueReloader {
    /// Reloads `live`, served through `upstream`, from what `load` reads (for the example
    /// gateway: the `GATEWAY_MODELS` file, with the same overrides as at start).
    pub fn new(
        live: LiveCatalogue,
        upstream: Upstream,
        load: impl Fn() -> Result<Catalogue, CatalogueError> + Send + Sync + 'static,
    ) -> CatalogueReloader {
        CatalogueReloader {
            live,
            upstream,
            load: Arc::new(load),
            running: Arc::default(),
        }
    }

    /// The catalogue served.
    pub fn live(&self) -> &LiveCatalogue {
        &self.live
    }

    /// Reads the catalogue again and serves it if it is valid; see the module docs.
    pub async fn reload(&self) -> Result<Arc<Catalogue>, ReloadError> {
        let _one_at_a_time = self.running.lock().await;
        let load = self.load.clone();
        let catalogue = tokio::task::spawn_blocking(move || load())
            .await
            .map_err(|_| CatalogueError::Read {
                path: "(the catalogue source)".into(),
                source: std::io::Error::other("the reading task panicked"),
            })??;
        if let Some(setting) = self.live.current().start_only_change(&catalogue) {
            return Err(StartOnlySetting(setting).into());
        }
        // The upstreams first: calls routed on the old catalogue still find theirs.
        self.upstream.reload(&catalogue)?;
        let served = self.live.replace(catalogue)?;
        tracing::info!(models = served.models().count(), "catalogue reloaded");
        Ok(served)
    }
}
