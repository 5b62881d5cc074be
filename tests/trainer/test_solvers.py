import torch

from trainer.solvers import dpm_rollout, euler_rollout, euler_step, rollout


def test_euler_step_hand_computed():
    x = torch.tensor([[1.0, 2.0]])
    v = torch.tensor([[0.5, -1.0]])
    torch.testing.assert_close(euler_step(x, v, 1.0, 0.75), torch.tensor([[0.875, 2.25]]))
    # per-sample times
    x2, v2 = torch.ones(2, 3), torch.ones(2, 3)
    out = euler_step(x2, v2, torch.tensor([1.0, 0.5]), torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(out, torch.stack([torch.full((3,), 0.5), torch.ones(3)]))


def test_rollouts_record_every_latent_and_the_grid(tiny_model):
    noise = torch.randn(3, *tiny_model.latent_shape)
    cond = tiny_model.encode_prompts(["one red circle", "two blue squares", "four green triangles"])
    for solver in ("euler", "dpm++"):
        traj = rollout(solver, tiny_model, noise, cond, 6)
        assert traj.latents.shape == (7, 3, *tiny_model.latent_shape)
        assert traj.timesteps.shape == (7,)
        assert torch.equal(traj.latents[0], noise)
        assert traj.timesteps[0] > 0.99 and traj.timesteps[-1] == 0.0
        assert (traj.timesteps[1:] < traj.timesteps[:-1]).all()


def test_euler_rollout_is_a_chain_of_euler_steps(tiny_model):
    noise = torch.randn(2, *tiny_model.latent_shape)
    cond = tiny_model.encode_prompts(["one red circle", "three yellow squares"])
    traj = euler_rollout(tiny_model, noise, cond, 4)
    with torch.no_grad():
        k = 2
        t = traj.timesteps[k].expand(2)
        step = euler_step(traj.latents[k], tiny_model(traj.latents[k], t, cond), traj.timesteps[k],
                          traj.timesteps[k + 1])
    torch.testing.assert_close(step, traj.latents[k + 1])


def test_dpm_solver_8_steps_is_closer_to_the_reference_than_euler_8(base_model):
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(16, *base_model.latent_shape, generator=gen)
    prompts = ["one red circle", "two blue squares", "three green triangles", "four yellow circles"] * 4
    cond = base_model.encode_prompts(prompts)
    reference = euler_rollout(base_model, noise, cond, 200).final
    err_dpm = (dpm_rollout(base_model, noise, cond, 8).final - reference).pow(2).mean()
    err_euler = (euler_rollout(base_model, noise, cond, 8).final - reference).pow(2).mean()
    assert err_dpm < 0.7 * err_euler, (err_dpm, err_euler)
