"""Resource manager: islands, hosts, devices, health, and the versioned virtual→physical map."""
