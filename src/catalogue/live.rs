//! The catalogue being served, replaced whole on a reload: every request reads the catalogue
//! as it stood when the request began, without a lock, and keeps it to its end (its model, its
//! price and its channels travel with it in [`RoutedCall`](crate::call::RoutedCall)).

use std::sync::Arc;

use arc_swap::ArcSwap;

use super::Catalogue;

/// The catalogue being served; cheap to clone (every clone serves the same one). Built from a
/// [`Catalogue`] or an `Arc<Catalogue>`, so wherever one is taken a fixed catalogue will do.
///
/// ```
/// use model_gateway::catalogue::{Catalogue, LiveCatalogue};
///
/// let live = LiveCatalogue::from(Catalogue::demo());
/// let before = live.current();
/// let empty = Catalogue::from_toml("").unwrap();
/// live.replace(empty).unwrap();
/// assert!(before.model("gpt-4o-mini").is_some()); // what a request holds stays whole
/// assert!(live.current().model("gpt-4o-mini").is_none());
/// ```
#[derive(Debug, Clone)]
pub struct LiveCatalogue {
    current: Arc<ArcSwap<Catalogue>>,
}

impl LiveCatalogue {
    /// Serves `catalogue`.
    pub fn new(catalogue: impl Into<Arc<Catalogue>>) -> LiveCatalogue {
        LiveCatalogue {
            current: Arc::new(ArcSwap::new(catalogue.into())),
        }
    }

    /// The catalogue served now.
    pub fn current(&self) -> Arc<Catalogue> {
        self.current.load_full()
    }

    /// Serves `catalogue` from now on, unless it changes a setting of the whole gateway
    /// ([`Catalogue::start_only_change`]), which is read at start: then the one served stays,
    /// and the error names the setting. Requests under way finish on the catalogue they began
    /// with.
    pub fn replace(&self, catalogue: Catalogue) -> Result<Arc<Catalogue>, StartOnlySetting> {
        if let Some(setting) = self.current().start_only_change(&catalogue) {
            return Err(StartOnlySetting(setting));
        }
        let catalogue = Arc::new(catalogue);
        self.current.store(catalogue.clone());
        Ok(catalogue)
    }
}

impl From<Catalogue> for LiveCatalogue {
    fn from(catalogue: Catalogue) -> LiveCatalogue {
        LiveCatalogue::new(catalogue)
    }
}

impl From<Arc<Catalogue>> for LiveCatalogue {
    fn from(catalogue: Arc<Catalogue>) -> LiveCatalogue {
        LiveCatalogue::new(catalogue)
    }
}

/// A reload refused because it changes a setting read at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is read when the gateway starts: restart it to change this setting")]
pub struct StartOnlySetting(pub &'static str);
