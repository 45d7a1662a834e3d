"""Mass-constrained kinematic fit of a lepton pair: least squares with a Lagrange multiplier.

Each lepton is measured as alpha = (k = 1/pT [1/GeV], eta, phi [rad]) with independent
Gaussian errors from a resolution model (``Resolution``). The fit finds the momenta
closest to the measured ones, in chi2 = (alpha - alpha0)^T V^-1 (alpha - alpha0), for
which the pair's invariant mass equals a target (m_Z). The constraint
h(alpha) = ln(M(alpha)^2 / m_Z^2) = 0 is linearised around the current estimate and the
step solved in closed form (P. Avery, "Applied fitting theory VI", CBX 98-37):

    D = dh/dalpha,  V_D = (D V D^T)^-1,  lambda = V_D (D (alpha0 - alpha) + h),
    alpha' = alpha0 - V D^T lambda,      chi2 = lambda^T V_D^-1 lambda,

repeated until |M - m_Z| and the chi2 change are below tolerance. The fitted
covariance is V' = V - V D^T V_D D V. With one constraint, chi2 follows a chi2
distribution with 1 degree of freedom for true on-shell Z decays measured with the
assumed resolution; off-shell (Z*) pairs get large chi2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

Z_MASS_GEV = 91.1876
MUON_MASS_GEV = 0.1056583755
Z_WIDTH_GEV = 2.4952


@dataclass(frozen=True)
class Resolution:
    """A simple muon resolution model.

    sigma(pT)/pT = ``pt_rel`` (+) ``pt_curv_per_gev`` * pT (in quadrature: multiple
    scattering, then the sagitta term), sigma(eta) = ``eta``, sigma(phi) = ``phi_rad``.
    """

    pt_rel: float = 0.02
    pt_curv_per_gev: float = 1e-4
    eta: float = 1e-3
    phi_rad: float = 1e-3

    def variances(self, pt_gev: np.ndarray) -> np.ndarray:
        """Variances of (k = 1/pT, eta, phi) per lepton, shape (n, 3); sigma_k/k = sigma_pT/pT."""
        rel = np.hypot(self.pt_rel, self.pt_curv_per_gev * pt_gev)
        out = np.empty((len(pt_gev), 3))
        out[:, 0] = (rel / pt_gev) ** 2
        out[:, 1] = self.eta**2
        out[:, 2] = self.phi_rad**2
        return out


@dataclass(frozen=True)
class PairFit:
    """Result of one constrained fit; momenta in GeV, angles in rad."""

    converged: bool
    n_iter: int
    chi2: float
    mass_measured_gev: float
    sigma_mass_gev: float  # measured-mass uncertainty from the resolution model
    mass_fit_gev: float
    pt_gev: np.ndarray  # fitted, shape (n,)
    eta: np.ndarray
    phi: np.ndarray


def four_vectors(
    pt: np.ndarray, eta: np.ndarray, phi: np.ndarray, mass_gev: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(E, px, py, pz) in GeV of leptons given (pT, eta, phi) and a common mass."""
    px = pt * np.cos(phi)
    py = pt * np.sin(phi)
    pz = pt * np.sinh(eta)
    e = np.sqrt(px * px + py * py + pz * pz + mass_gev * mass_gev)
    return e, px, py, pz


def pair_mass(pt: np.ndarray, eta: np.ndarray, phi: np.ndarray, mass_gev: float) -> float:
    """Invariant mass (GeV) of the sum of the leptons."""
    e, px, py, pz = four_vectors(pt, eta, phi, mass_gev)
    m2 = e.sum() ** 2 - px.sum() ** 2 - py.sum() ** 2 - pz.sum() ** 2
    return math.sqrt(m2) if m2 > 0 else 0.0


def _constraint(alpha: np.ndarray, mass_gev: float, target_gev: float) -> tuple[float, np.ndarray]:
    """h = ln(M^2 / target^2) and its gradient dh/d(k, eta, phi) for every lepton (flat).

    The logarithm makes the constraint nearly linear in k = 1/pT (M^2 ~ 1/(k1 k2)),
    so that pairs far from the target converge in a few steps; it has the same zero
    set, hence the same fit, as M^2 - target^2.
    """
    k, eta, phi = alpha[0::3], alpha[1::3], alpha[2::3]
    pt = 1.0 / k
    e, px, py, pz = four_vectors(pt, eta, phi, mass_gev)
    se, sx, sy, sz = e.sum(), px.sum(), py.sum(), pz.sum()
    m2 = se * se - sx * sx - sy * sy - sz * sz
    # dM^2/dq = 2 (S_E dE/dq - S_p . dp/dq) for a parameter q of one lepton
    p2 = px * px + py * py + pz * pz
    dpt = 2.0 * (se * p2 / (e * pt) - (sx * px + sy * py + sz * pz) / pt)  # per unit pT
    cosh = np.cosh(eta)
    deta = 2.0 * (se * pz * pt * cosh / e - sz * pt * cosh)
    dphi = 2.0 * (sx * py - sy * px)  # dpx/dphi = -py, dpy/dphi = px, dE/dphi = 0
    grad = np.empty_like(alpha)
    grad[0::3] = dpt * (-pt * pt) / m2  # dpT/dk = -pT^2; d ln M^2 = dM^2 / M^2
    grad[1::3] = deta / m2
    grad[2::3] = dphi / m2
    return math.log(m2 / (target_gev * target_gev)), grad


def sigma_mass(alpha: np.ndarray, var: np.ndarray, mass_gev: float) -> float:
    """sigma(M) in GeV by error propagation: sigma(ln M^2) = 2 sigma(M) / M."""
    k, eta, phi = alpha[0::3], alpha[1::3], alpha[2::3]
    m = pair_mass(1.0 / k, eta, phi, mass_gev)
    _, d = _constraint(alpha, mass_gev, max(m, 1e-9))
    return 0.5 * m * math.sqrt(float(d @ (var * d)))


def _measured(
    pt_gev: np.ndarray, eta: np.ndarray, phi: np.ndarray, res: Resolution
) -> tuple[np.ndarray, np.ndarray]:
    """alpha0 = (1/pT, eta, phi) per lepton (flat) and its variances."""
    pt0 = np.asarray(pt_gev, dtype=np.float64)
    alpha0 = np.column_stack([1.0 / pt0, eta, phi]).ravel()
    return alpha0, res.variances(pt0).ravel()


def _iterate(
    alpha0: np.ndarray,
    var: np.ndarray,
    alpha: np.ndarray,
    lepton_mass_gev: float,
    target_gev: float,
    max_iter: int,
    tol_mass_gev: float,
    tol_chi2: float,
) -> tuple[np.ndarray, float, float, bool, int]:
    """Constrained least squares from the start ``alpha``: (alpha, chi2, lambda, ok, n_iter)."""
    chi2 = prev = lam = math.inf
    h, d = _constraint(alpha, lepton_mass_gev, target_gev)
    for n_iter in range(1, max_iter + 1):
        dvd = float(d @ (var * d))  # D V D^T (a scalar: one constraint)
        lam = (float(d @ (alpha0 - alpha)) + h) / dvd
        full = alpha0 - var * d * lam - alpha
        # damped step: halve it while it makes some pT negative or the constraint worse
        # (far off-shell pairs: the linearisation overshoots)
        t = 1.0
        while True:
            step = alpha + t * full
            if np.all(step[0::3] > 0.0):
                h_new, d_new = _constraint(step, lepton_mass_gev, target_gev)
                if abs(h_new) <= abs(h) or t < 1e-3:
                    break
            elif t < 1e-3:
                return alpha, chi2, lam, False, n_iter
            t *= 0.5
        alpha, h, d = step, h_new, d_new
        chi2 = float(((alpha - alpha0) ** 2 / var).sum())
        m_fit = target_gev * math.exp(0.5 * h)
        if abs(m_fit - target_gev) < tol_mass_gev and abs(chi2 - prev) < tol_chi2 * max(1.0, chi2):
            return alpha, chi2, lam, True, n_iter
        prev = chi2
    return alpha, chi2, lam, False, max_iter


def _result(
    alpha: np.ndarray,
    chi2: float,
    ok: bool,
    n_iter: int,
    alpha0: np.ndarray,
    var: np.ndarray,
    lepton_mass_gev: float,
) -> PairFit:
    k0, eta0, phi0 = alpha0[0::3], alpha0[1::3], alpha0[2::3]
    m_meas = pair_mass(1.0 / k0, eta0, phi0, lepton_mass_gev)
    sigma_m = sigma_mass(alpha0, var, lepton_mass_gev)
    k, eta, phi = alpha[0::3], alpha[1::3], alpha[2::3]
    return PairFit(
        converged=ok,
        n_iter=n_iter,
        chi2=float(chi2),
        mass_measured_gev=m_meas,
        sigma_mass_gev=sigma_m,
        mass_fit_gev=pair_mass(1.0 / k, eta, phi, lepton_mass_gev),
        pt_gev=1.0 / k,
        eta=eta.copy(),
        phi=phi.copy(),
    )


def fit_mass_constraint(
    pt_gev: np.ndarray,
    eta: np.ndarray,
    phi: np.ndarray,
    *,
    lepton_mass_gev: float = MUON_MASS_GEV,
    target_gev: float = Z_MASS_GEV,
    resolution: Resolution | None = None,
    max_iter: int = 30,
    tol_mass_gev: float = 1e-7,
    tol_chi2: float = 1e-9,
) -> PairFit:
    """Fit the leptons' (1/pT, eta, phi) so that their invariant mass is ``target_gev``.

    Converged: |M_fit - target| < ``tol_mass_gev`` and the chi2 changed by less than
    ``tol_chi2`` (relative, at least absolute) in the last step. Not converged: the
    iteration limit was hit or a step made some pT negative (far off-shell pairs);
    the last estimate is returned then.
    """
    alpha0, var = _measured(pt_gev, eta, phi, resolution or Resolution())
    alpha, chi2, _, ok, n_iter = _iterate(
        alpha0, var, alpha0.copy(), lepton_mass_gev, target_gev, max_iter, tol_mass_gev, tol_chi2
    )
    return _result(alpha, chi2, ok, n_iter, alpha0, var, lepton_mass_gev)


def breit_wigner_penalty(
    m_gev: float, mass_gev: float = Z_MASS_GEV, width_gev: float = Z_WIDTH_GEV
) -> float:
    """-2 ln of the relativistic Breit-Wigner 1 / ((m^2 - M^2)^2 + M^2 G^2), up to a constant."""
    return 2.0 * math.log((m_gev * m_gev - mass_gev * mass_gev) ** 2 + (mass_gev * width_gev) ** 2)


def fit_lineshape(
    pt_gev: np.ndarray,
    eta: np.ndarray,
    phi: np.ndarray,
    *,
    lepton_mass_gev: float = MUON_MASS_GEV,
    resolution: Resolution | None = None,
    n_scan: int = 5,
    precision: float = 0.2,
    max_refine: int = 20,
) -> tuple[PairFit, float]:
    """Fit with the Z line shape instead of a fixed mass: minimise chi2(m) - 2 ln BW(m).

    chi2(m) is the constrained fit to mass m (profile over the momenta); the total is
    scanned at ``n_scan`` masses between the measured mass and m_Z (the minimum lies
    between them, and within a few resolutions of the measured mass) and refined by
    golden-section steps around the best scan point until the bracket is below
    ``precision`` times the measured-mass resolution (at most ``max_refine`` steps);
    each fit starts from the previous solution. Returns the fit at
    the best mass and its total -2 ln L (chi2 plus the Breit-Wigner penalty, relative
    to the penalty at the pole). Off-shell pairs keep a mass near the measured one;
    near-on-shell pairs move towards m_Z by their resolution.
    """
    alpha0, var = _measured(pt_gev, eta, phi, resolution or Resolution())
    m_meas = pair_mass(np.asarray(pt_gev, dtype=np.float64), eta, phi, lepton_mass_gev)
    pole = breit_wigner_penalty(Z_MASS_GEV)
    sigma_m = sigma_mass(alpha0, var, lepton_mass_gev)
    # the best mass m* has chi2(m*) <= penalty(m_meas) - penalty(pole), so it lies
    # within ~sigma_m * sqrt(that) of m_meas (with a margin for the non-linearity)
    window = 1.5 * sigma_m * math.sqrt(max(breit_wigner_penalty(m_meas) - pole, 1.0))
    if m_meas < Z_MASS_GEV:
        lo, hi = m_meas, min(Z_MASS_GEV, m_meas + window)
    else:
        lo, hi = max(Z_MASS_GEV, m_meas - window), m_meas
    cache: dict[float, tuple[float, np.ndarray, float, bool, int]] = {}
    start = alpha0.copy()

    def total(m: float) -> float:
        nonlocal start
        alpha, chi2, _, ok, n_iter = _iterate(
            alpha0, var, start, lepton_mass_gev, m, 30, 1e-6, 1e-7
        )
        if not ok:  # retry from the measurement before giving up on this mass
            alpha, chi2, _, ok, n_iter = _iterate(
                alpha0, var, alpha0.copy(), lepton_mass_gev, m, 30, 1e-6, 1e-7
            )
        value = (chi2 if ok else math.inf) + breit_wigner_penalty(m) - pole
        if ok:
            start = alpha
        cache[m] = (value, alpha, chi2, ok, n_iter)
        return value

    grid = np.linspace(lo, hi, n_scan)
    values = [total(float(m)) for m in grid]
    best = int(np.argmin(values))
    a, b = float(grid[max(best - 1, 0)]), float(grid[min(best + 1, n_scan - 1)])
    inv_phi = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = b - inv_phi * (b - a), a + inv_phi * (b - a)
    fc, fd = total(c), total(d)
    for _ in range(max_refine):
        if b - a < precision * sigma_m:
            break
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - inv_phi * (b - a)
            fc = total(c)
        else:
            a, c, fc = c, d, fd
            d = a + inv_phi * (b - a)
            fd = total(d)
    m_best = min(cache, key=lambda m: cache[m][0])
    value, alpha, chi2, ok, n_iter = cache[m_best]
    return _result(alpha, chi2, ok, n_iter, alpha0, var, lepton_mass_gev), value
