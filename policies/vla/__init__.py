"""kinema's vision-language-action policy with a flow-matching action expert."""

from policies.vla.configuration_vla import VLAConfig
from policies.vla.modeling_vla import VLAPolicy

__all__ = ["VLAConfig", "VLAPolicy"]
